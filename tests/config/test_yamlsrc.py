import pytest

from hpcscale.config.errors import ConfigError
from hpcscale.config.yamlsrc import format_path, parse_yaml


def test_lines_of_nested_keys_and_list_items():
    src = parse_yaml("a: 1\nb:\n  c: x\n  d:\n    - e: 1\n    - e: 2\n", "f.yaml")
    assert src.data == {"a": 1, "b": {"c": "x", "d": [{"e": 1}, {"e": 2}]}}
    assert src.line_of(("a",)) == 1
    assert src.line_of(("b", "c")) == 3
    assert src.line_of(("b", "d", 1, "e")) == 6
    # a key that is not there points at its nearest ancestor
    assert src.line_of(("b", "d", 1, "missing")) == 6


def test_duplicate_key_is_an_error_with_its_line():
    with pytest.raises(ConfigError) as e:
        parse_yaml("a: 1\nb: 2\na: 3\n", "f.yaml")
    assert str(e.value) == "f.yaml:3: a: duplicate key"


def test_merge_keys_and_anchors_work_like_safe_load():
    src = parse_yaml("base: &b {x: 1, y: 2}\nc:\n  <<: *b\n  y: 3\n", "f.yaml")
    assert src.data["c"] == {"x": 1, "y": 3}


def test_syntax_error_names_the_line():
    with pytest.raises(ConfigError) as e:
        parse_yaml("a: 1\nb: [1, 2\nc: 3\n", "f.yaml")
    assert str(e.value).startswith("f.yaml:")
    assert "invalid YAML" in str(e.value)


def test_empty_document_is_none():
    assert parse_yaml("", "f.yaml").data is None


def test_format_path():
    assert format_path(("partitions", 0, "name")) == "partitions[0].name"

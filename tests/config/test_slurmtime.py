import pytest

from hpcscale.util.slurmtime import format_duration, parse_duration


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 1800),
        (30, 1800),
        ("30:15", 1815),
        ("01:00:00", 3600),
        ("2-00", 172800),
        ("1-02:03", 93780),
        ("1-02:03:04", 93784),
        ("100:00:00", 360000),
    ],
)
def test_every_sbatch_form(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "1:2:3:4", "01:61:00", "1-25:00:00", "abc", "-5", "1h"])
def test_bad_forms(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_format_round_trip():
    assert format_duration(93784) == "1-02:03:04"
    assert format_duration(3600) == "01:00:00"
    assert parse_duration(format_duration(93784)) == 93784

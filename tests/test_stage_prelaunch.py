"""`hpcscale stage` starts ssh from its raw arguments before click loads (hpcscale.xsite.channel.prelaunch,
about 50 ms sooner). That scan must know every option click knows for `stage`, and whether it takes a value:
otherwise a value that looks like an option is read as one, and the wrong connection (or none) is started."""

from __future__ import annotations

import click
import pytest

from hpcscale.cli.main import cli
from hpcscale.cli.stage_cmd import stage
from hpcscale.xsite.channel import NO_EARLY_START, STAGE_OPTIONS, scan_stage_args


def _options() -> list[click.Option]:
    """stage's options as the real CLI builds them (help names come from the group's context settings)."""
    ctx = click.Context(stage, parent=click.Context(cli, **cli.context_settings), info_name="stage")
    return [p for p in stage.get_params(ctx) if isinstance(p, click.Option)]


def test_the_scan_knows_every_option_of_stage_and_whether_it_takes_a_value():
    names = set()
    for opt in _options():
        takes_value = not opt.is_flag and not opt.count
        for name in (*opt.opts, *opt.secondary_opts):
            names.add(name)
            assert name in STAGE_OPTIONS, f"teach hpcscale.xsite.channel.STAGE_OPTIONS the stage option {name}"
            assert STAGE_OPTIONS[name] == takes_value, f"{name}: STAGE_OPTIONS says takes a value={not takes_value}"
    assert set(STAGE_OPTIONS) == names, f"not options of stage: {sorted(set(STAGE_OPTIONS) - names)}"


# values chosen to look like options: a scan that does not step over them reads --to or --from wrongly
VALUES = {
    "--bwlimit": "--to",
    "--site": "--from",
    "--check": "hash",
    "--jobs": "3",
    "--ssh": "ssh -p 2222 -o BatchMode=yes",
    "--remote-python": "env PYTHONPATH=/x python3",
    "--from": "/data/src",
    "--to": "ssh://user@dtn.example.org:2200/~/dst",
}


@pytest.mark.parametrize("form", ["spaced", "equals"])
def test_the_scan_reads_what_click_parses(tmp_path, form):
    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    argv = [str(manifest), "--sync", "--json"]
    for name, value in VALUES.items():
        argv += [f"{name}={value}"] if form == "equals" else [name, value]
    parsed = stage.make_context("stage", list(argv)).params
    assert scan_stage_args(argv) == {
        "--from": parsed["src"],
        "--to": parsed["dst"],
        "--ssh": parsed["ssh_cmd"],
        "--remote-python": parsed["remote_python"],
    }


@pytest.mark.parametrize("extra", NO_EARLY_START)
def test_nothing_starts_early_for_help_dry_runs_and_double_dashes(extra):
    assert scan_stage_args(["m.json", "--from", "/a", "--to", "ssh://h/b", extra]) is None

"""`hpcscale stage --site S`: the site config's staging keys set the defaults of -j and --bwlimit, and an
explicit option wins. Proven through the real command: the --json summary reports the streams and the cap
used, and a capped copy takes the time the cap says."""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from conftest import REPO
from test_stage import build, make_tree, same_tree, ssh_args, stage, stage_json

from hpcscale.xsite import DEFAULT_JOBS


def site_file(tmp_path: Path, **staging) -> str:
    """This machine's site config (site_configs/local.yaml) with the given `staging:` keys."""
    doc = yaml.safe_load((REPO / "site_configs" / "local.yaml").read_text())
    doc["staging"] = staging
    path = tmp_path / "site.yaml"
    path.write_text(yaml.safe_dump(doc))
    return str(path)


def test_staging_jobs_sets_the_streams_and_an_explicit_j_wins(tmp_path):
    src = make_tree(tmp_path / "src", small=12)
    build(src)
    m = src / "manifest.json"
    site = site_file(tmp_path, jobs=3)
    by_site = stage_json(m, str(src), str(tmp_path / "a"), "--site", site)
    assert by_site["streams"] == 3 and by_site["sent"] == 13 and by_site["committed"]
    same_tree(src, tmp_path / "a")
    assert stage_json(m, str(src), str(tmp_path / "b"), "--site", site, "-j", "2")["streams"] == 2
    assert stage_json(m, str(src), str(tmp_path / "c"))["streams"] == DEFAULT_JOBS  # no site: the default


def test_staging_jobs_sets_the_ssh_connections(tmp_path, sshd):
    src = make_tree(tmp_path / "src", small=12)
    build(src)
    site = site_file(tmp_path, jobs=2)
    r = stage_json(src / "manifest.json", str(src), sshd.url(tmp_path / "remote"), "--site", site, *ssh_args(sshd))
    assert r["streams"] == 2 and r["sent"] == 13 and r["committed"]
    same_tree(src, tmp_path / "remote")


def test_staging_bandwidth_limit_caps_the_rate_and_an_explicit_bwlimit_wins(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(2_000_000))
    build(src)
    m = src / "manifest.json"
    site = site_file(tmp_path, bandwidth_limit_mbps=1)  # MB of 10^6 bytes
    capped = stage_json(m, str(src), str(tmp_path / "a"), "--site", site)
    assert capped["bwlimit"] == 1e6 and capped["sent"] == 1
    assert capped["seconds"] >= 1.9  # 2 MB at 1 MB/s, less the 50 ms burst allowance
    explicit = stage_json(m, str(src), str(tmp_path / "b"), "--site", site, "--bwlimit", "1G")
    assert explicit["bwlimit"] == 1 << 30 and explicit["sent"] == 1 and explicit["seconds"] < 1.0
    assert stage_json(m, str(src), str(tmp_path / "c"))["bwlimit"] is None  # no site: no cap


def test_an_unknown_site_exits_2_naming_it(tmp_path):
    src = make_tree(tmp_path / "src", small=1)
    build(src)
    r = stage(src / "manifest.json", str(src), str(tmp_path / "dst"), "--site", "no-such-site")
    assert r.returncode == 2, r.stderr
    assert "no-such-site" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "dst").exists()

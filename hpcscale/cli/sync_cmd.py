"""`hpcscale sync`: cross-site rounds, one tick per call (cron), their status, and site keys (docs/cross-site.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hpcscale.cli.options import json_option, print_json

_config = click.option(
    "--config",
    "config_path",
    required=True,
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="The cross-site config (the same file on every site).",
)
_site = click.option("--site", "site", required=True, help="This site's name in the config.")


def _load(config_path: Path):
    from hpcscale.config.xsite import load_xsite

    return load_xsite(config_path)


@click.group(invoke_without_command=True)
@click.option("--config", "config_path", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
              help="The cross-site config (the same file on every site).")  # fmt: skip
@click.option("--site", "site", default=None, help="This site's name in the config.")
@json_option
@click.pass_context
def sync(ctx: click.Context, config_path: Path | None, site: str | None, as_json: bool) -> None:
    """One tick of the cross-site rounds for SITE: export this site's finished rounds as signed contributions,
    push them to the aggregator; on the aggregator, apply a round once a quorum is in and push it to every site;
    hand the newest verified global weights to this site's run. Idempotent; a second tick started while one
    runs exits 0 at once. Run it from cron on every site:

    \b
      * * * * *  hpcscale sync --config /etc/hpcscale/xsite.yaml --site a >> ~/xsite-a.log 2>&1

    Exit codes: 0 done (or nothing to do, or another tick is running), 1 a stage failed (a site unreachable:
    retried next tick), 2 bad config or key, 3 never (rejected contributions are reported, not fatal).
    """
    if ctx.invoked_subcommand is not None:
        return
    if config_path is None or site is None:
        raise click.UsageError("hpcscale sync needs --config and --site (or a subcommand: status, keygen)")
    from hpcscale.xsite.rounds import tick

    report = tick(_load(config_path), site)
    if as_json:
        print_json({"site": report.site, "locked_out": report.locked_out, "events": report.events,
                    "errors": report.errors})  # fmt: skip
    elif report.locked_out:
        click.echo(f"another sync tick is running for site {site}: {report.locked_out}")
    else:
        for e in report.events:
            fields = " ".join(f"{k}={v}" for k, v in e.items() if k not in ("time", "site", "event"))
            click.echo(f"{site}: {e['event']} {fields}".rstrip())
        for err in report.errors:
            click.echo(f"error: {err}", err=True)
    sys.exit(1 if report.errors else 0)


@sync.command("status")
@_config
@_site
@json_option
def status_cmd(config_path: Path, site: str, as_json: bool) -> None:
    """This site's view of the rounds: published rounds (the aggregator) with the sites they averaged and
    those they rejected (and why), this site's contributions, the rounds in its inbox, bytes sent and received,
    and the bytes sent per round and destination (egress: what sites pay for; the newest 20 rounds)."""
    from hpcscale.xsite.rounds import status

    doc = status(_load(config_path), site)
    if as_json:
        print_json(doc)
        return
    click.echo(
        f"site {doc['site']} (aggregator: {doc['aggregator']}); "
        f"bytes sent {doc['bytes_sent']}, received {doc['bytes_received']}"
    )
    pending = doc.get("pending")
    if pending is not None:
        since = "" if pending["waiting_since"] is None else f", first contribution at {pending['waiting_since']:.0f}"
        click.echo(f"  round {pending['round']:4d}  pending{since}")
        if pending["blocked"]:
            click.echo(f"              blocked: {pending['blocked']}")
        if pending.get("behind"):
            click.echo(f"              behind: {pending['behind']}")
        for site, reason in sorted(pending["rejected"].items()):
            click.echo(f"              rejected {site}: {reason}")
    for r in doc["rounds"]:
        acc = ", ".join(f"{a['site']} ({a['tokens']} tokens, {a['steps']} steps)" for a in r["accepted"]) or "-"
        wait = "" if r.get("quorum_wait_s") is None else f"  (quorum after {r['quorum_wait_s']} s)"
        click.echo(f"  round {r['round']:4d}  averaged: {acc}{wait}")
        for rej in r["rejected"]:
            click.echo(f"              rejected {rej['site']}: {rej['reason']}")
    by_round: dict[int, list[str]] = {}
    for e in doc["egress"]:
        by_round.setdefault(e["round"], []).append(f"{e['to']} {e['bytes']}")
    for r, cells in sorted(by_round.items())[-20:]:
        click.echo(f"  round {r:4d}  bytes sent to: {', '.join(cells)}")
    click.echo(f"  contributions sent: {', '.join(doc['contributions']) or 'none'}")
    click.echo(f"  rounds received:    {', '.join(doc['inbox']) or 'none'}")
    for e in doc["errors"]:
        click.echo(f"  last errors: {e.get('stage')}: {e.get('error')}")


@sync.command("keygen")
@click.option("--site", "site", required=True, help="The site the key is for.")
@click.option("--out", "out", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for SITE.key (mode 0600) and SITE.pub.")  # fmt: skip
def keygen_cmd(site: str, out: Path) -> None:
    """Make SITE's ed25519 key pair. Copy SITE.pub into every site's `keys` directory; keep SITE.key on SITE.
    OUT is made (mode 0700) or must be yours or root's and writable by no one else."""
    from hpcscale.util.trust import private_dir
    from hpcscale.xsite.signing import generate_key

    # made by a mkdir that fails when the name exists, or one of yours no one else can write: whoever can write
    # the directory could swap the key after it is made
    private_dir(out, what="directory of the site's keys", mode=0o700)
    private, public = generate_key(out, site)
    click.echo(f"private key: {private}\npublic key:  {public}")

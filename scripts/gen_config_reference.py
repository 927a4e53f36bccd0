#!/usr/bin/env python3
"""Write docs/config-reference.md from the config schemas (hpcscale/config/site.py and job.py).

Every key, its type, default and doc come from the dataclass fields themselves, so the reference cannot
drift from the code; tests/house/test_docs.py fails when the committed file is stale. Regenerate with:

    python scripts/gen_config_reference.py
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from pathlib import Path

from hpcscale.config.fields import yaml_key
from hpcscale.config.job import JobSpec
from hpcscale.config.site import SiteConfig
from hpcscale.config.train import TrainConfig
from hpcscale.config.xsite import XsiteConfig

OUT = Path(__file__).resolve().parent.parent / "docs" / "config-reference.md"

HEADER = """# Configuration reference

Generated from the schemas by `python scripts/gen_config_reference.py`; do not edit by hand.

Two kinds of YAML file configure hpcscale:

- a **site config** (`site_configs/<name>.yaml`) describes one cluster, or this machine, once;
- a **job spec** describes one training job and names its site with `site:`.

Site names are looked up, first match wins, in `$HPCSCALE_SITE_PATH` (colon-separated absolute directories),
`~/.config/hpcscale/sites`, and the site configs shipped with hpcscale (never in the working directory; a file
found by name that is not shipped must be yours or root's and writable by no one else); `site:` may also be a
path to a site file (relative to the job spec). Unknown keys are errors (with a did-you-mean); every error
reads `FILE:LINE: KEY: MESSAGE` and exits with code 2. Paths may use `~` and `$VARIABLES`, expanded when used.
Any job spec key can also be set on the command line of `run`, `submit`, `render` and `config validate` with
`-p KEY=VALUE` (`-p train.params.lr=3e-4`), checked like the file; its errors read `command line -p KEY: MESSAGE`
([user-guide.md](user-guide.md#overriding-keys-from-the-command-line--p-keyvalue)).
Check files with `hpcscale config validate FILE...`; see a site with every default filled in with
`hpcscale config show SITE`.
"""

RULES = {
    SiteConfig: """
Rules across keys: partition names are unique and at most one is `default`; a `slurm` site has at least one
partition; a `local` site launches with `mpirun`; with `topology.source: file` every switch lists exactly one
of `nodes` or `switches`, every child switch exists, and every partition node sits on a leaf switch.
""",
    TrainConfig: """
Rules across keys and the layout (dp = world / (tp × pp)): `n_embd` is a multiple of `n_head`, `n_head` of `tp`;
`n_layer ≥ pp`; `global_batch` is a multiple of `dp × micro_batch`, and with 1F1B the number of micro-batches
(`global_batch / (dp × micro_batch)`) is at least `pp`; `min_lr ≤ lr`. The same job trains the same model at
any layout that satisfies these: only speed changes, never the losses.
""",
    JobSpec: """
Rules across keys (checked against the job's site): `tp × pp` divides the world size
`nodes × tasks_per_node` (dp is the quotient) and `dp_shard` divides dp; `tp` divides `tasks_per_node`, so
tensor-parallel groups stay inside a node; the partition exists and has at least `nodes` nodes, `gpus_per_node` GPUs and
`tasks_per_node × cpus_per_task` cores per node; `time_limit` is within the partition's `max_time`; `train` and
`command` exclude each other; on a `local` site `nodes` is 1; `xsite` needs the built-in trainer, a cross-site
config that loads, and a site of it.
""",
    XsiteConfig: """
One file, the same on every site ([cross-site.md](cross-site.md)). Rules across keys: site names are unique;
`aggregator` is one of them; `quorum.min_sites` is at most the number of sites.
""",
}


def type_name(tp: typing.Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is typing.Any:
        return "any"
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        inner = [type_name(a) for a in args if a is not type(None)]
        return " \\| ".join(inner) + (" \\| null" if type(None) in args else "")
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is dict:
        return f"map of {type_name(args[1])}"
    if dataclasses.is_dataclass(tp):
        return f"[{tp.__name__}](#{tp.__name__.lower()})"
    return {str: "string", int: "integer", float: "number", bool: "boolean"}.get(tp, str(tp))


def default_text(f: dataclasses.Field, tp: typing.Any) -> str:
    if f.default is not dataclasses.MISSING:
        if f.default is None:
            return "null"
        if f.default == "":
            return '`""`'
        return f"`{str(f.default).lower() if isinstance(f.default, bool) else f.default}`"
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):
            return "see section"
        return "`[]`" if value == [] else "`{}`"
    return "**required**"


def limits(f: dataclasses.Field) -> str:
    lo, hi = f.metadata.get("min"), f.metadata.get("max")
    parts = ([f"≥ {lo:g}"] if lo is not None else []) + ([f"≤ {hi:g}"] if hi is not None else [])
    return f" ({', '.join(parts)})" if parts else ""


def section(cls: type, prefix: str, out: list[str], seen: set[type]) -> None:
    if cls in seen:
        return
    seen.add(cls)
    hints = typing.get_type_hints(cls)
    out.append(f"\n### {cls.__name__}\n\n`{prefix or '(top level)'}`: {cls.__doc__.strip()}\n")
    out.append("| key | type | default | meaning |\n|---|---|---|---|")
    nested = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        doc = f.metadata["doc"].replace("|", "\\|") + limits(f)
        out.append(f"| `{yaml_key(f)}` | {type_name(tp)} | {default_text(f, tp)} | {doc} |")
        for candidate in (tp, *typing.get_args(tp)):
            for inner in (candidate, *typing.get_args(candidate)):
                if dataclasses.is_dataclass(inner):
                    key = yaml_key(f) + ("[]" if typing.get_origin(candidate) is list else "")
                    nested.append((inner, f"{prefix}.{key}" if prefix else key))
    if cls in RULES:
        out.append(RULES[cls])
    for inner, path in nested:
        section(inner, path, out, seen)


def render() -> str:
    out = [HEADER]
    for title, cls, prefix in (
        ("Site config", SiteConfig, ""),
        ("Job spec", JobSpec, ""),
        ("Built-in trainer parameters", TrainConfig, "train.params"),
        ("Cross-site config (`hpcscale sync --config`)", XsiteConfig, ""),
    ):
        out.append(f"\n## {title}\n")
        section(cls, prefix, out, set())
    return "\n".join(out).rstrip() + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}", file=sys.stderr)

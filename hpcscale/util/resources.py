"""Where the files hpcscale ships beside its code live: the sbatch templates and the example site configs.

Both sit at the top of the repository (`sbatch_templates/`, `site_configs/`) because users copy from them, and
the wheel carries a copy of each inside the package (`hpcscale/sbatch_templates/`, `hpcscale/site_configs/`;
pyproject.toml's force-include). So the lookup is, first match wins:

1. the copy inside the installed package: a wheel install;
2. the checkout's top-level directory, beside the `hpcscale/` package and its `pyproject.toml`: an editable
   install or a source tree on sys.path.

Nothing else is searched (not the working directory: `render` must not depend on where it is run from), and
a missing directory is an error that names both places. Stdlib only: every layer may import this.
"""

from __future__ import annotations

from pathlib import Path

from hpcscale.errors import RuntimeFailure

TEMPLATES = "sbatch_templates"
SITE_CONFIGS = "site_configs"

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # .../hpcscale
CHECKOUT_DIR = PACKAGE_DIR.parent  # the repository root for an editable install; site-packages for a wheel


def candidates(name: str) -> list[Path]:
    """The places `name` is looked for, in order."""
    return [PACKAGE_DIR / name, CHECKOUT_DIR / name]


def find_shipped(name: str) -> Path | None:
    """The directory `name` (TEMPLATES or SITE_CONFIGS) that this hpcscale ships, or None."""
    installed, checkout = candidates(name)
    if installed.is_dir():
        return installed
    # Only a real checkout: a stray site-packages/site_configs from some other package is not ours.
    if checkout.is_dir() and (CHECKOUT_DIR / "pyproject.toml").is_file():
        return checkout
    return None


def shipped_dir(name: str) -> Path:
    """Like find_shipped, but a missing directory is an error saying where it was looked for."""
    found = find_shipped(name)
    if found is None:
        where = " or ".join(str(p) for p in candidates(name))
        raise RuntimeFailure(
            f"{name}/ is missing from this hpcscale installation (looked in {where}); "
            "reinstall hpcscale from its wheel, or `pip install -e .` from a checkout"
        )
    return found


def templates_dir() -> Path:
    """The built-in sbatch templates (`default.sbatch.j2`, ... and the `_header.j2` they include)."""
    return shipped_dir(TEMPLATES)


def site_configs_dir() -> Path:
    """The site configs shipped with hpcscale (`local`, `localcluster`, the `example-*` sites)."""
    return shipped_dir(SITE_CONFIGS)

"""Our top-level packages must own their import names: transformers 5.25 made Hugging Face's `kernels` distribution
(import name `kernels`) a dependency, and our package of that name then broke both (from the repository root ours
shadowed it and `transformers.modeling_utils` failed to import; from an installed copy it shadowed ours)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def our_packages() -> list[str]:
    """The top-level packages pyproject.toml installs (its packages.find include patterns, matched against the
    repository's package folders)."""
    text = (ROOT / "pyproject.toml").read_text()
    patterns = re.findall(r'"([\w*]+)"', re.search(r"^include = \[(.*)\]$", text, re.M).group(1))
    folders = [p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()]
    return sorted(f for f in folders if any(re.fullmatch(p.replace("*", ".*"), f) for p in patterns))


def test_top_level_import_names_belong_to_no_other_distribution():
    names = our_packages()
    assert {"kivi", "kivi_kernels", "pipeline", "jobs"} <= set(names), names
    owners = importlib.metadata.packages_distributions()
    for name in names:
        others = sorted({d for d in owners.get(name, []) if d.lower().replace("_", "-") != "kivi-ray"})
        assert not others, f"import name {name!r} is also installed by {others}: one would shadow the other"


def test_our_import_names_resolve_to_this_repository():
    for name in our_packages():
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        assert Path(spec.origin).resolve().is_relative_to(ROOT), (name, spec.origin)

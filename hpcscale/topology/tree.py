"""Switch trees: from `scontrol show topology`, from a site file, or flat; and the distance between nodes.

Distance is the cost model's unit (docs/placement.md): 0 on the same node, 1 under the same leaf switch,
and one more for every level further up the lowest common switch sits. Nodes in different trees (no common
switch) are one level further than the highest switch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from hpcscale.errors import BadInput
from hpcscale.util.hostlist import BadHostlist, expand


class BadTopology(BadInput):
    """A malformed topology description; the message names the line or switch."""


@dataclass(frozen=True, slots=True)
class Switch:
    name: str
    level: int
    nodes: tuple[str, ...]  # leaf switches: their nodes; upper switches: every node below them
    children: tuple[str, ...]  # child switch names (empty for leaves)


@dataclass(slots=True)
class SwitchTree:
    switches: dict[str, Switch]
    leaf_of: dict[str, str] = field(default_factory=dict)  # node -> leaf switch
    parent: dict[str, str] = field(default_factory=dict)  # switch -> parent switch

    def __post_init__(self) -> None:
        for sw in self.switches.values():
            for child in sw.children:
                if child not in self.switches:
                    raise BadTopology(f"switch '{sw.name}' lists unknown switch '{child}'")
                if child in self.parent and self.parent[child] != sw.name:
                    raise BadTopology(f"switch '{child}' has two parents: '{self.parent[child]}' and '{sw.name}'")
                self.parent[child] = sw.name
            if not sw.children:
                for n in sw.nodes:
                    if n in self.leaf_of and self.leaf_of[n] != sw.name:
                        raise BadTopology(f"node '{n}' is on two leaf switches: '{self.leaf_of[n]}' and '{sw.name}'")
                    self.leaf_of[n] = sw.name
        self._check_acyclic()

    def _check_acyclic(self) -> None:
        for name in self.switches:
            seen = {name}
            cur = name
            while cur in self.parent:
                cur = self.parent[cur]
                if cur in seen:
                    raise BadTopology(f"switch '{name}' is its own ancestor")
                seen.add(cur)

    @property
    def height(self) -> int:
        return max((s.level for s in self.switches.values()), default=0)

    def ancestors(self, node: str) -> list[str]:
        """Switches above `node`, leaf first; [] for a node on no switch."""
        out = []
        cur = self.leaf_of.get(node)
        while cur is not None:
            out.append(cur)
            cur = self.parent.get(cur)
        return out

    def distance(self, a: str, b: str) -> int:
        if a == b:
            return 0
        up_a = self.ancestors(a)
        common = set(self.ancestors(b))
        for sw in up_a:
            if sw in common:
                return self.switches[sw].level + 1
        return self.height + 2

    def roots(self) -> list[str]:
        return [n for n in self.switches if n not in self.parent]

    def leaves(self) -> list[str]:
        return [n for n, s in self.switches.items() if not s.children]

    def restricted_to(self, nodes: Iterable[str]) -> dict[str, list[str]]:
        """leaf switch -> the given nodes under it, leaves in tree order; nodes on no switch under ''."""
        keep = list(nodes)
        order = {leaf: i for i, leaf in enumerate(self.leaf_order())}
        out: dict[str, list[str]] = {}
        for n in keep:
            out.setdefault(self.leaf_of.get(n, ""), []).append(n)
        return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))

    def leaf_order(self) -> list[str]:
        """Leaf switches in depth-first order, so that leaves under one parent are adjacent."""
        out: list[str] = []

        def walk(name: str) -> None:
            sw = self.switches[name]
            if not sw.children:
                out.append(name)
            for child in sw.children:
                walk(child)

        for root in sorted(self.roots()):
            walk(root)
        return out


def build_tree(entries: list[tuple[str, list[str] | None, list[str] | None]]) -> SwitchTree:
    """A tree from (name, nodes, child switches) entries; levels computed from the structure."""
    by_name: dict[str, tuple[list[str], list[str]]] = {}
    for name, nodes, children in entries:
        if name in by_name:
            raise BadTopology(f"switch '{name}' is defined twice")
        by_name[name] = (nodes or [], children or [])
    level: dict[str, int] = {}

    def level_of(name: str, depth: int = 0) -> int:
        if depth > len(by_name):
            raise BadTopology(f"switch '{name}' is its own ancestor")
        if name not in level:
            _, children = by_name[name]
            missing = [c for c in children if c not in by_name]
            if missing:
                raise BadTopology(f"switch '{name}' lists unknown switch '{missing[0]}'")
            level[name] = 0 if not children else 1 + max(level_of(c, depth + 1) for c in children)
        return level[name]

    for name in by_name:  # validates children and catches cycles before the walk below relies on both
        level_of(name)
    switches = {}
    for name, (nodes, children) in by_name.items():
        below = list(nodes)
        stack = list(children)
        while stack:
            child_nodes, grand = by_name[stack.pop()]
            below += child_nodes
            stack += grand
        switches[name] = Switch(name, level_of(name), tuple(dict.fromkeys(below)), tuple(children))
    return SwitchTree(switches)


_FIELD = re.compile(r"(\w+)=(\S*)")


def parse_scontrol_topology(text: str, source: str = "scontrol show topology") -> SwitchTree:
    """Parse `scontrol show topology` (one `SwitchName=... Level=... Nodes=... Switches=...` per line)."""
    entries = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        fields = dict(_FIELD.findall(line))
        if "SwitchName" not in fields:
            raise BadTopology(f"{source}:{lineno}: no SwitchName in '{line.strip()[:80]}'")
        try:
            switches = expand(fields["Switches"]) if fields.get("Switches") else None
            # scontrol lists every node below an upper switch; only leaves' nodes define membership.
            nodes = expand(fields["Nodes"]) if fields.get("Nodes") and not switches else None
        except BadHostlist as e:
            raise BadTopology(f"{source}:{lineno}: {e}") from None
        entries.append((fields["SwitchName"], nodes, switches))
    if not entries:
        raise BadTopology(f"{source}: no switches (is TopologyPlugin=topology/tree set?)")
    try:
        return build_tree(entries)
    except BadTopology as e:
        raise BadTopology(f"{source}: {e}") from None


def flat_tree(nodes: Iterable[str]) -> SwitchTree:
    """Every node under one virtual switch: the model for `topology.source: none`."""
    return build_tree([("all", list(nodes), None)])


def parse_topology_addr(addr: str, pattern: str) -> list[str]:
    """SLURM_TOPOLOGY_ADDR (`spine.leaf1.n1`) with SLURM_TOPOLOGY_ADDR_PATTERN (`switch.switch.node`):
    the switches above this node, top first. BadTopology if the two do not match."""
    names, kinds = addr.split("."), pattern.split(".")
    if len(names) != len(kinds) or not names or kinds[-1] != "node" or any(k != "switch" for k in kinds[:-1]):
        raise BadTopology(f"SLURM_TOPOLOGY_ADDR '{addr}' does not match pattern '{pattern}'")
    if any(not n for n in names):
        raise BadTopology(f"SLURM_TOPOLOGY_ADDR '{addr}' has an empty field")
    return names[:-1]

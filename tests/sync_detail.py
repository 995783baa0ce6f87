"""Copy one RLHF detail from a script to every shipped script that defines it, for a change made on purpose in all of
them (tests/test_layout.py holds the shipped scripts' details identical and names this command when they differ):

    python tests/sync_detail.py apply_missing_eos_penalty rloo.py

A function, class or top-level assignment is replaced whole, decorators included; scripts without it are left alone."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import ROOT, SHIPPED, definitions  # noqa: E402


def sync(name, source_script):
    """Write `source_script`'s definition of `name` into every other shipped script that defines it; returns them."""
    source = definitions(source_script)[name][1]
    changed = []
    for script in SHIPPED:
        found = definitions(script)
        if script == source_script or name not in found or found[name][1] == source:
            continue
        path = os.path.join(ROOT, script)
        with open(path) as f:
            text = f.read()
        assert text.count(found[name][1]) == 1, f"{script}: {name} is not one block"
        with open(path, "w") as f:
            f.write(text.replace(found[name][1], source))
        changed.append(script)
    return changed


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    name, script = sys.argv[1], os.path.basename(sys.argv[2])
    if name not in definitions(script):
        sys.exit(f"error: {script} defines no {name}")
    print(f"{name} copied from {script} to: {', '.join(sync(name, script)) or 'none (they already agree)'}")

"""Driver run inside the head's namespace: trains with the critic pinned to the worker host and prints where
each role ran (one JSON line starting with WHERE) and the names of the placement groups the run created, oldest
first (one JSON line starting with PLACEMENT_GROUPS)."""
import json
import sys
from pathlib import Path

import ray

from fleetrl.cluster.runtime import ensure_ray
from fleetrl.config import derive_plan, load_config
from fleetrl.tracking.tracker import Tracker
from fleetrl.trainer.supervisor import Supervisor
from fleetrl.trainer.trainer import Trainer

out = Path(sys.argv[1])
overrides = sys.argv[2:]
cfg = load_config("examples/ppo_tiny.yaml", overrides + ["tracking.console=false", "tracking.progress=false",
                                                          f"trainer.output_dir={out}"])
plan = derive_plan(cfg)
ensure_ray(cfg.cluster)
out.mkdir(parents=True, exist_ok=True)
tracker = Tracker(out, cfg.tracking, {}, "netns")
seen = {}
original_fit = Trainer.fit


def fit_and_record(self):
    try:
        return original_fit(self)
    finally:
        # the node of each role as its group recorded it when built: no call on the workers, which after a frozen
        # node would wait out a stall (cluster.stall_s plus a stack dump) per group
        if self.groups:
            seen.update({r: self.group(r).infos[0]["ip"] for r in self.plan.roles})


Trainer.fit = fit_and_record
Supervisor(plan, tracker, out).run()
tracker.close()
print("WHERE " + json.dumps(seen), flush=True)
names = [t["name"] for t in ray.util.placement_group_table().values()]  # removed ones too
print("PLACEMENT_GROUPS " + json.dumps(sorted(names, key=lambda n: int(n.rsplit("-", 1)[1]))), flush=True)

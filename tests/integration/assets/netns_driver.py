"""Driver run inside the head's namespace: trains with the critic pinned to the worker host and prints where
each role ran (one JSON line starting with WHERE)."""
import json
import sys
from pathlib import Path

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
        if self.groups:
            try:
                seen.update({r: self.group(r).node_infos()[0]["ip"] for r in self.plan.roles})
            except Exception:  # a group lost its node: nothing to record for this attempt
                pass


Trainer.fit = fit_and_record
Supervisor(plan, tracker, out).run()
tracker.close()
print("WHERE " + json.dumps(seen), flush=True)

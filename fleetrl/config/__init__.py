"""Run config: schema (typed, frozen), loading with overrides, and the one validate-and-derive step."""
from fleetrl.config.load import (
    ConfigError,
    apply_override,
    dump_yaml,
    load_config,
    redacted_dict,
    to_dict,
    write_config,
)
from fleetrl.config.plan import Plan, PoolPlan, check_plan, derive_plan
from fleetrl.config.schema import RunConfig

__all__ = ["ConfigError", "Plan", "PoolPlan", "RunConfig", "apply_override", "check_plan", "derive_plan",
           "dump_yaml", "load_config", "redacted_dict", "to_dict", "write_config"]

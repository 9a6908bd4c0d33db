"""The `fleetrl` command. Each command is a few lines that call the library; no logic lives here."""
from __future__ import annotations

import json
import logging
from typing import List, Optional

import typer
from rich.console import Console

app = typer.Typer(help="fleetrl: RL post-training of LLMs on Ray (PPO, GRPO and relatives).",
                  no_args_is_help=True, pretty_exceptions_enable=False)
config_app = typer.Typer(help="Inspect run configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
console = Console()


def _fail(e: Exception) -> None:
    console.print(f"[bold red]error:[/] {e}")
    raise typer.Exit(2)


@app.command()
def train(config: str = typer.Argument(..., help="Run config YAML."),
          overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides, e.g. actor.optim.lr=1e-6"),
          ) -> None:
    """Train with CONFIG (starts a local Ray cluster when cluster.address is not set)."""
    from fleetrl.config import ConfigError
    from fleetrl.trainer.run import train as run_train

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        run_train(config, list(overrides or []))
    except (ConfigError, ValueError) as e:
        _fail(e)


@config_app.command("show")
def config_show(config: str = typer.Argument(..., help="Run config YAML."),
                overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides")) -> None:
    """Print the resolved config and the derived plan (world sizes, per-rank batch sizes, pools)."""
    from fleetrl.config import ConfigError, derive_plan, dump_yaml, load_config

    try:
        plan = derive_plan(load_config(config, list(overrides or [])))
    except (ConfigError, ValueError) as e:
        _fail(e)
    console.rule("config")
    console.print(dump_yaml(plan.config), highlight=False)
    console.rule("plan")
    console.print_json(json.dumps(plan.summary()))


def _register_ops() -> None:
    try:
        from fleetrl.cli import ops
    except ImportError:  # ops commands not available in this build
        return
    ops.register(app)


_register_ops()

if __name__ == "__main__":
    app()

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
    console.print(f"[bold red]error:[/] {e}", soft_wrap=True, highlight=False)
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


@app.command()
def export(checkpoint: str = typer.Argument(..., help="A checkpoint folder (OUT/checkpoints/step_N)."),
           hf: str = typer.Option(..., "--hf", help="Output folder for the Hugging Face model."),
           dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 | float16 (default: as trained)."),
           from_deltas: bool = typer.Option(False, "--from-deltas",
                                            help="Rebuild from the base model + every delta.safetensors up to CHECKPOINT.")) -> None:
    """Write a Hugging Face model folder (config, safetensors, tokenizer) from a checkpoint."""
    from fleetrl.checkpoint.export import CheckpointError, export_hf
    from fleetrl.checkpoint.manager import export_via_deltas

    try:
        out = export_via_deltas(checkpoint, hf, dtype=dtype) if from_deltas else export_hf(checkpoint, hf, dtype=dtype)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        _fail(e)
    console.print(f"wrote {out}")


from fleetrl.cli import ops  # noqa: E402  (cluster, doctor, jobs, recipes, reward server)

ops.register(app)
from fleetrl.cli import data as data_cli  # noqa: E402

data_cli.register(app)

if __name__ == "__main__":
    app()

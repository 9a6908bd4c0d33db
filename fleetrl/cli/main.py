"""The `fleetrl` command. Each command is a few lines that call the library; no logic lives here."""
from __future__ import annotations

import json
import logging
from typing import List, Optional

import typer
from rich.console import Console
from rich.text import Text

from fleetrl.cli.errors import report, user_errors
from fleetrl.errors import UserError

app = typer.Typer(help="fleetrl: RL post-training of LLMs on Ray (PPO, GRPO and relatives).",
                  no_args_is_help=True, pretty_exceptions_enable=False)
config_app = typer.Typer(help="Inspect run configs.", no_args_is_help=True)
app.add_typer(config_app, name="config")
console = Console()


@app.command()
@user_errors()
def train(config: str = typer.Argument(..., help="Run config YAML."),
          overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides, e.g. actor.optim.lr=1e-6"),
          ) -> None:
    """Train with CONFIG (starts a local Ray cluster when cluster.address is not set)."""
    from fleetrl.trainer.run import train as run_train
    from fleetrl.trainer.signals import Interrupted

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        run_train(config, list(overrides or []))
    except Interrupted as e:  # the run already printed where it stopped and how to continue
        raise typer.Exit(e.exit_code) from None
    except UserError:  # one line from user_errors; never a lost worker, so no need to import Ray to ask (~4 s)
        raise
    except Exception as e:
        from fleetrl.cluster.health import is_recoverable  # imports Ray: only once a run has failed

        if not is_recoverable(e):
            raise
        report(e)  # a lost/stalled worker with no restarts left: the message is the diagnosis, not a traceback
        raise typer.Exit(1) from None


@config_app.command("show")
@user_errors()
def config_show(config: str = typer.Argument(..., help="Run config YAML."),
                overrides: Optional[List[str]] = typer.Argument(None, help="key=value overrides")) -> None:
    """Print the resolved config and the derived plan (world sizes, per-rank batch sizes, pools)."""
    from fleetrl.config import dump_yaml, load_config
    from fleetrl.trainer.run import plan_for

    plan = plan_for(load_config(config, list(overrides or [])))
    console.rule("config")
    console.print(Text(dump_yaml(plan.config)))
    console.rule("plan")
    console.print_json(json.dumps(plan.summary()))


@app.command()
@user_errors(FileNotFoundError)
def export(checkpoint: str = typer.Argument(..., help="A checkpoint folder (OUT/checkpoints/step_N)."),
           hf: str = typer.Option(..., "--hf", help="Output folder for the Hugging Face model."),
           dtype: Optional[str] = typer.Option(None, help="float32 | bfloat16 | float16 (default: as trained)."),
           from_deltas: bool = typer.Option(False, "--from-deltas",
                                            help="Rebuild from the base model + every delta.safetensors up to CHECKPOINT.")) -> None:
    """Write a Hugging Face model folder (config, safetensors, tokenizer) from a checkpoint."""
    from fleetrl.checkpoint.export import check_export_dtype, export_hf
    from fleetrl.checkpoint.manager import export_via_deltas

    check_export_dtype(dtype)  # both paths: a bad --dtype fails before the model is loaded
    out = export_via_deltas(checkpoint, hf, dtype=dtype) if from_deltas else export_hf(checkpoint, hf, dtype=dtype)
    console.print(Text(f"wrote {out}"), soft_wrap=True)


from fleetrl.cli import ops  # noqa: E402  (cluster, doctor, jobs, recipes, reward server)

ops.register(app)
from fleetrl.cli import sweep as _sweep  # noqa: E402  (sweep, report)

_sweep.register(app)
from fleetrl.cli import data as data_cli  # noqa: E402  (data make)

data_cli.register(app)

if __name__ == "__main__":
    app()

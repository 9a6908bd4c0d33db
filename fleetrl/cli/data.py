"""`fleetrl data ...`: make training data offline. The logic lives in fleetrl/data/make.py."""
from __future__ import annotations

import typer
from rich.console import Console

console = Console()


def data_make(
    task: str = typer.Argument(..., help="A reasoning-gym dataset (basic_arithmetic, gsm_symbolic, chain_sum, ...) "
                                          "or gsm8k:PATH.jsonl (GSM8K-format rows: question, answer '... #### N')."),
    out: str = typer.Option(..., "--out", help="Output folder for train.parquet and val.parquet."),
    n_train: int = typer.Option(1000, "--n-train", help="Training prompts."),
    n_val: int = typer.Option(200, "--n-val", help="Validation prompts (disjoint from training)."),
    seed: int = typer.Option(0, "--seed", help="Generator / shuffle seed."),
    answer_format: str = typer.Option("auto", "--format", help="auto | gsm8k ('#### N') | boxed (\\boxed{})."),
    option: list[str] | None = typer.Option(  # noqa: B008 (typer's idiom)
        None, "--option", "-o", help="reasoning-gym config field KEY=VALUE (lists: a,b or JSON), e.g. -o max_terms=2."),
) -> None:
    """Write verl-format parquet (data_source, prompt, reward_model.ground_truth, extra_info) to OUT."""
    from fleetrl.data.errors import DataError
    from fleetrl.data.make import make_data, parse_options

    try:
        options = parse_options(option or [])
        made = make_data(task, out, n_train=n_train, n_val=n_val, seed=seed, answer_format=answer_format,
                         options=options)
    except DataError as e:
        console.print(f"[bold red]error:[/] {e}", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None
    console.print(f"wrote {made.train} ({made.num_train} rows)"
                  + (f" and {made.val} ({made.num_val} rows)" if made.val else "")
                  + f"; data_source {made.data_source!r}, answers as {made.answer_format}", highlight=False)


def register(app: typer.Typer) -> None:
    """Adds `fleetrl data make` to `app`."""
    data_app = typer.Typer(help="Make training data offline.", no_args_is_help=True)
    data_app.command("make")(data_make)
    app.add_typer(data_app, name="data")

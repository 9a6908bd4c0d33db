"""How every command reports a user's mistake: one line, `error: ...`, exit code 2. Anything else is a bug and
keeps its traceback. The text is printed literally: error messages quote paths and log lines full of `[...]`,
which rich would otherwise read as markup (and raise on)."""
from __future__ import annotations

import functools
from typing import Callable, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from fleetrl.errors import UserError

F = TypeVar("F", bound=Callable)
err_console = Console(stderr=True, highlight=False)


def report(e: BaseException) -> None:
    err_console.print(Text.assemble(("error: ", "bold red"), str(e)), soft_wrap=True)


def user_errors(*extra: type[BaseException]) -> Callable[[F], F]:
    """Decorator: UserError (and the `extra` types a command knows to be the user's to fix) -> one line, exit 2."""
    caught = (UserError, *extra)

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except typer.Exit:  # click's Exit derives from RuntimeError: let it through untouched
                raise
            except caught as e:
                report(e)
                raise typer.Exit(2) from None
        return wrapper  # type: ignore[return-value]
    return wrap

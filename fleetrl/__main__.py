"""`python -m fleetrl ...` is the `fleetrl` command, for scripts that hold an interpreter rather than a PATH."""
from fleetrl.cli.main import app

app(prog_name="fleetrl")

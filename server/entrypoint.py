"""The Docker image's entry point: `hfport serve` with an API token guaranteed.

The image listens on 0.0.0.0 (inside a container that is the only way a published port reaches it), and the server
refuses a non-loopback bind without HFPORT_API_TOKEN. When the user gives none, one is generated on the first start,
kept in the data volume (api_token, readable by its owner only, so a restart keeps the same token) and printed once,
on the start that made it."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

from hfport.errors import SettingsError

from .settings import Settings, make_data_dir

TOKEN_FILE = "api_token"


def ensure_token(data_dir: Path, given: str | None) -> tuple[str, bool]:
    """(the token to serve with: GIVEN (the api_token setting) when set, else the data dir's; whether it was generated
    now). A token file that cannot be read or made (a folder in its place, a dangling link, no permission) is a
    SettingsError naming the settings, the path and the OS's reason, not a traceback."""
    if given:
        return given, False
    path = data_dir / TOKEN_FILE
    where = (f"{Settings.env_name('api_token')} is not set and the token kept for it in data_dir "
             f"({Settings.env_name('data_dir')}) {str(path)!r}")
    if os.path.lexists(path):  # anything there is the token the first start made: never replaced by a new one
        try:
            token = path.read_text().strip()
        except OSError as e:
            raise SettingsError(f"{where} cannot be read: {e.strerror or e}") from None
        if not token:
            raise SettingsError(f"{where} is empty: delete it to have a new one made, or set the variable")
        return token, False
    make_data_dir(data_dir)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, never overwritten
    except OSError as e:
        raise SettingsError(f"{where} cannot be made: {e.strerror or e}") from None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


def main() -> None:
    # two settings read alone: the others may not pass their checks yet (a non-loopback host needs the token made here)
    try:
        data_dir = Settings.env_value("data_dir")  # the image sets HFPORT_DATA_DIR=/data
        token, new = ensure_token(data_dir, Settings.env_value("api_token"))
    except SettingsError as e:  # a bad value, a volume this process cannot write in: one line, as `hfport serve`
        print(f"error: invalid settings: {e}", file=sys.stderr)
        sys.exit(1)
    if new:
        print(f"hfport: no HFPORT_API_TOKEN was set; generated one (kept in {data_dir / TOKEN_FILE}):\n"
              f"  {token}\nSend it as 'Authorization: Bearer <token>'. Set HFPORT_API_TOKEN to choose your own.",
              file=sys.stderr, flush=True)
    # the token reaches `hfport serve` as its api_token setting, in the new process's environment only (never argv)
    os.execvpe("hfport", ["hfport", "serve", *sys.argv[1:]], {**os.environ, Settings.env_name("api_token"): token})


if __name__ == "__main__":
    main()

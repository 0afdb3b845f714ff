"""One settings surface (issue 45 item 2): the library's settings in hfport.settings, the server's in
server/settings.py, each field in a group, at most 30 in all; docs/settings.md generated from them (stale: this
fails); `hfport serve --help` lists every variable; a bad value or a retired variable is one SettingsError naming the
variable, the value and what is accepted (or what replaced it); the library reads the environment once, and
use()/reset() change and forget what it read; every HFPORT_* name the code and the docs mention is a setting."""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import re
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import hfport.settings
from hfport import verbosity
from hfport.cli import app
from hfport import int8_verdicts
from hfport.errors import SettingsError
from hfport.export import int8_choice
from hfport.hardware import CACHE_FILE, cache_root
from hfport.modeling import _DTYPES
from hfport.settings import GROUPS
from hfport.settings import Settings as LibrarySettings
from hfport.train.distill import TEACHER_DIR
from hfport.train.grouped import SPILL_DIR
import server.__main__
import server.app
import server.worker
from server.app import create_app
from server.settings import Settings as ServerSettings
from server.store import open_store
from server.worker import Worker

REPO = Path(__file__).resolve().parents[1]
CLASSES = (LibrarySettings, ServerSettings)
TEST_VARIABLES = {"HFPORT_CHAOS_JOBS"}  # read by tests/test_chaos.py only (docs/benchmarks.md says how to run it)


def _generator():
    spec = importlib.util.spec_from_file_location("gen_settings_doc", REPO / "scripts" / "gen_settings_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the surface --------------------------------------------------------------------------------------------------


def test_docs_settings_md_is_the_generators_output():
    gen = _generator()
    assert gen.PAGE.read_text() == gen.render(), f"docs/settings.md is stale: run `{gen.COMMAND}`"


def test_at_most_30_settings_each_in_a_group_with_a_meaning():
    names = [(cls.__module__, n) for cls in CLASSES for n in cls.model_fields]
    assert len(names) <= 30, names
    for cls in CLASSES:
        for name, field in cls.model_fields.items():
            assert hfport.settings.group(field) in GROUPS, f"{cls.__module__}.{name}: no group"
            assert field.description, f"{cls.__module__}.{name}: no description"
    env = [cls.env_name(n) for cls in CLASSES for n in cls.model_fields]
    assert len(env) == len(set(env)), "one variable, two settings"
    retired = {name for cls in CLASSES for name in cls.retired}
    assert not retired & set(env), "a retired variable is a setting again"


def test_serve_help_lists_every_variable():
    result = CliRunner().invoke(app, ["serve", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for cls in CLASSES:
        for name, field in cls.model_fields.items():
            line = f"{cls.env_name(name)}: {hfport.settings.type_text(field)}, default"
            assert line in result.output, (line, result.output[-3000:])
    assert "Server settings, common:" in result.output and "Server settings, advanced:" in result.output
    assert "docs/settings.md" in result.output


def test_every_hfport_variable_mentioned_is_a_setting():
    """The code, the scripts, the README and docs/ name only settings (or the retired ones, in their tables).
    docs/benchmarks.md is left out: a record of past runs, each with the settings of its commit."""
    known = {cls.env_name(n) for cls in CLASSES for n in cls.model_fields} | TEST_VARIABLES
    retired = {name for cls in CLASSES for name in cls.retired}
    files = [*REPO.glob("hfport/**/*.py"), *REPO.glob("server/**/*.py"), *REPO.glob("scripts/*.py"),
             REPO / "README.md", *[p for p in REPO.glob("docs/*.md") if p.name != "benchmarks.md"],
             REPO / "Dockerfile"]
    stray = set()
    for path in files:
        text = path.read_text()
        for name in set(re.findall(r"HFPORT_[A-Z0-9_]*[A-Z0-9]", text)) - known:
            if name in retired and path.name in ("settings.py", "settings.md"):
                continue  # the tables that say what replaced them
            stray.add(f"{path.relative_to(REPO)}: {name}")
    assert not stray, "\n".join(sorted(stray))


def test_a_renamed_variable_in_the_benchmark_records_comes_with_its_current_name():
    """docs/benchmarks.md keeps each run's record as it ran, but a paragraph naming a variable that was renamed (the
    retired table's replacement is a setting: HFPORT_LEASE_S -> HFPORT_JOB_LEASE_S) names the current one too, so a
    user copying the setting gets one that works (its chaos run read "HFPORT_LEASE_S=5" alone)."""
    known = {cls.env_name(n) for cls in CLASSES for n in cls.model_fields}
    renamed = {old: now.group(0) for cls in CLASSES for old, instead in cls.retired.items()
               if (now := re.match(r"HFPORT_[A-Z0-9_]*[A-Z0-9]", instead)) and now.group(0) in known}
    assert renamed["HFPORT_LEASE_S"] == "HFPORT_JOB_LEASE_S"
    text = (REPO / "docs" / "benchmarks.md").read_text()
    missing = [f"{old} without {now}: {paragraph[:80]!r}" for paragraph in re.split(r"\n\s*\n", text)
               for old, now in renamed.items() if re.search(rf"\b{old}\b", paragraph) and now not in paragraph]
    assert not missing, "\n".join(missing)


def test_nothing_reads_an_hfport_variable_but_the_settings_classes():
    """CONTRIBUTING: a setting is a field, never an os.environ read elsewhere (where it would skip the validation, the
    docs and `serve --help`). Writing one into a child's environment is fine."""
    read = re.compile(r"""(environ\.get|getenv)\(\s*["']HFPORT_|environ\[\s*["']HFPORT_[A-Z_]*["']\s*\](?!\s*=[^=])""")
    files = [*REPO.glob("hfport/**/*.py"), *REPO.glob("server/**/*.py"), *REPO.glob("scripts/*.py")]
    readers = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in files
               for n, line in enumerate(path.read_text().splitlines(), 1) if read.search(line)]
    assert not readers, "\n".join(readers)


def test_the_cache_settings_name_every_folder_the_library_keeps_in_the_cache():
    """teacher/ (a distillation's teacher outputs, capped by store_max_bytes like encoded/) and int8-paths/ were kept
    there unsaid."""
    cache = LibrarySettings.model_fields["cache_dir"].description
    kept = [CACHE_FILE, f"{int8_verdicts.FOLDER}/", f"{int8_choice.FOLDER}/", "embeddings/", "encoded/",
            f"{TEACHER_DIR}/", f"{SPILL_DIR}/"]
    assert [name for name in kept if name not in cache] == [], cache
    capped = LibrarySettings.model_fields["store_max_bytes"].description
    assert "cache_dir/encoded/" in capped and f"cache_dir/{TEACHER_DIR}/" in capped, capped


# --- the library: read once, changed and forgotten cleanly --------------------------------------------------------


def test_library_settings_are_read_once_then_changed_and_forgotten(tmp_path, monkeypatch):
    monkeypatch.setenv("HFPORT_CACHE_DIR", str(tmp_path / "a"))
    monkeypatch.setenv("HFPORT_VERBOSITY", "Debug ")
    assert cache_root() == tmp_path / "a" and verbosity.from_env() == "debug"
    monkeypatch.setenv("HFPORT_CACHE_DIR", str(tmp_path / "b"))
    assert cache_root() == tmp_path / "a"  # read once: a change of the environment is not seen ...
    hfport.settings.reset()
    assert cache_root() == tmp_path / "b"  # ... until reset()
    changed = hfport.settings.use(store_max_bytes=5, cache_dir="~/elsewhere")
    assert hfport.settings.settings() is changed and changed.verbosity == "debug"  # the rest as read
    assert changed.cache_dir == Path("~/elsewhere").expanduser() and changed.store_max_bytes == 5
    with pytest.raises(SettingsError, match=r"store_max_bytes=-1: input should be greater than or equal to 0 "
                                            r"\(accepted: int >= 0\)"):
        hfport.settings.use(store_max_bytes=-1)
    assert hfport.settings.settings() is changed  # a refused change leaves the settings as they were
    monkeypatch.delenv("HFPORT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HFPORT_VERBOSITY", "")  # empty: unset
    hfport.settings.reset()
    assert cache_root() == tmp_path / "xdg" / "hfport" and verbosity.from_env("normal") == "normal"


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("HFPORT_VERBOSITY", "loud", r"HFPORT_VERBOSITY='loud': input should be 'quiet', 'normal', 'verbose', 'debug' "
                                 r"or 'trace' \(accepted: quiet \| normal \| verbose \| debug \| trace \| unset\)"),
    ("HFPORT_STORE_MAX_BYTES", "20G", r"HFPORT_STORE_MAX_BYTES='20G': input should be a valid integer.*"
                                      r"\(accepted: int >= 0\)"),
    ("HFPORT_STREAM_BYTES", "0", r"HFPORT_STREAM_BYTES is no longer a setting: fixed: a source of 256 MiB or more "
                                 r"is encoded to disk .*unset it"),
    ("HFPORT_STORE_WAIT_S", "10", r"HFPORT_STORE_WAIT_S is no longer a setting: .* STORE_WAIT_S\)"),
])
def test_a_bad_library_variable_is_one_error_naming_it(monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError, match=message):
        hfport.settings.settings()


@pytest.mark.parametrize("flag", ["-q", "-v"])
def test_a_bad_library_variable_stops_a_command_in_one_line_with_a_verbosity_flag_too(monkeypatch, flag):
    """A flag decides the verbosity without HFPORT_VERBOSITY, so the settings were first read later, wherever the
    command needed them: the error escaped as a traceback (and `serve -v` started with them unread)."""
    monkeypatch.setenv("HFPORT_STORE_MAX_BYTES", "20G")
    result = CliRunner().invoke(app, ["info", "--hardware", flag])
    assert result.exit_code == 1 and not isinstance(result.exception, SettingsError), result.exception
    assert "error: HFPORT_STORE_MAX_BYTES='20G': input should be a valid integer" in result.output, result.output


def test_serve_logs_at_the_verbosity_the_variable_or_a_flag_names(tmp_path, monkeypatch):
    """uvicorn's level followed -q alone: HFPORT_VERBOSITY=quiet left its info lines on, and -vv (debug) too. The
    job worker gets the same level, for its job processes (role all, and role worker without uvicorn), from the
    entry point: `python -m server` alike."""
    levels, workers = [], []
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: levels.append(kw["log_level"]))
    monkeypatch.setattr(server.app, "Worker", lambda *a, verbosity: workers.append(verbosity) or Worker(*a))
    monkeypatch.setattr(server.app, "run_worker", lambda settings, store, verbosity: workers.append(verbosity))
    for variable, flags in (("quiet", []), ("", ["-q"]), ("quiet", ["-v"]), ("", []), ("debug", []), ("", ["-vv"]),
                            ("quiet", ["-vv", "--role", "worker"])):
        monkeypatch.setenv("HFPORT_VERBOSITY", variable)
        hfport.settings.reset()
        result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path), *flags])
        assert result.exit_code == 0, result.output
    assert levels == [logging.ERROR, logging.ERROR, logging.INFO, logging.INFO, logging.DEBUG, logging.DEBUG]
    assert workers == ["quiet", "quiet", "verbose", "verbose", "debug", "debug", "debug"]
    monkeypatch.setenv("HFPORT_VERBOSITY", "quiet")
    hfport.settings.reset()
    server.__main__.main()
    assert levels[-1] == logging.ERROR and workers[-1] == "quiet"


PROBE = """import logging, sys

import hfport
from server import fence


def export(*args, **kwargs):
    for level in ("debug", "info", "warning", "error"):
        getattr(logging.getLogger("hfport.export"), level)("probe at %s", level)
    raise RuntimeError("the probe ends the job here")


hfport.export = export  # in this job process only: the job module server.fence runs finds this engine
sys.exit(fence.main(sys.argv[sys.argv.index("server.jobrun"):]))
"""


def test_a_job_process_logs_at_the_level_serve_was_given(tmp_path, monkeypatch):
    """`serve -q` and `-vv` did not reach the job processes the server starts: they followed HFPORT_VERBOSITY (here
    normal: warnings, no debug), else verbose. Each server below is `hfport serve` as the CLI builds it, its worker
    in this process; the job process is a real one (fence and jobrun) over an export engine that logs a record at
    each level and fails."""
    script, wrapper = tmp_path / "probe_jobrun.py", tmp_path / "python-probe"
    script.write_text(PROBE)
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(server.worker.sys, "executable", str(wrapper))
    monkeypatch.setenv("HFPORT_VERBOSITY", "normal")
    apps = []
    monkeypatch.setattr("uvicorn.run", lambda app, **kw: apps.append(app))
    for flag in ("-q", "-vv"):
        hfport.settings.reset()
        result = CliRunner().invoke(app, ["serve", flag, "--data-dir", str(tmp_path / flag)])
        assert result.exit_code == 0, result.output
    logs = {}
    with TestClient(apps[0]), TestClient(apps[1]):  # their lifespans start the workers
        jobs = [a.state.store.create_job("export", {"model": str(tmp_path), "output_dir": str(tmp_path / "out")})
                for a in apps]
        deadline = time.time() + 120
        for flag, a, job in zip(("-q", "-vv"), apps, jobs):
            while a.state.store.get_job(job["id"])["status"] != "failed" and time.time() < deadline:
                time.sleep(0.1)
            logs[flag] = (tmp_path / flag / "runs" / job["id"] / "job.log").read_text(errors="replace")
            assert "the probe ends the job here" in logs[flag], logs[flag][-3000:]
    shown = {flag: [level for level in ("debug", "info", "warning", "error") if f"probe at {level}" in text]
             for flag, text in logs.items()}
    assert shown == {"-q": ["error"], "-vv": ["debug", "info", "warning", "error"]}, logs


# --- the server's ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("HFPORT_PORT", "http", r"HFPORT_PORT='http': input should be a valid integer.*\(accepted: int >= 0, <= 65535\)"),
    ("HFPORT_ROLE", "boss", r"HFPORT_ROLE='boss': input should be 'api', 'worker' or 'all' \(accepted: api \| "
                            r"worker \| all\)"),
    ("HFPORT_BATCH_TOKEN_BUDGETS", "[0]", r"HFPORT_BATCH_TOKEN_BUDGETS='\[0\]': input should be greater than 0"),
    # a list setting's value that is not JSON: refused naming the variable, not in pydantic-settings' own words
    ("HFPORT_ALLOWED_DIRS", "/data/models", r"HFPORT_ALLOWED_DIRS='/data/models': input should be a valid list "
                                            r"\(accepted: JSON list of Path\)"),
    ("HFPORT_BATCH_TOKEN_BUDGETS", "1024,2048", r"HFPORT_BATCH_TOKEN_BUDGETS='1024,2048': input should be a valid "
                                                r"list \(accepted: JSON list of int\)"),
    # a float setting is finite: inf passed `gt=0`, then every job process refused its lease margin (inf < inf)
    ("HFPORT_JOB_LEASE_S", "inf", r"HFPORT_JOB_LEASE_S='inf': input should be a finite number \(accepted: float > 0\)"),
    ("HFPORT_BATCH_MAX_WAIT_MS", "1e400", r"HFPORT_BATCH_MAX_WAIT_MS='1e400': input should be a finite number"),
    ("HFPORT_LEASE_S", "10", r"HFPORT_LEASE_S is no longer a setting: HFPORT_JOB_LEASE_S \(one name for the lease\)"),
    ("HFPORT_JOB_HEARTBEAT_S", "1", r"HFPORT_JOB_HEARTBEAT_S is no longer a setting: derived: HFPORT_JOB_LEASE_S / 15"),
    ("HFPORT_MODEL_CACHE_SIZE", "4", r"HFPORT_MODEL_CACHE_SIZE is no longer a setting: HFPORT_MODEL_CACHE_MB"),
])
def test_a_bad_server_variable_is_one_error_naming_it(tmp_path, monkeypatch, variable, value, message):
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError, match=message):
        ServerSettings(data_dir=tmp_path)


def test_a_database_url_is_a_postgresql_url_and_its_value_stays_out_of_the_error(tmp_path, monkeypatch):
    """Anything but postgresql:// (or postgres://) was opened as a SQLite file of that name in the working directory;
    the refusal names the variable but not the value, which may hold the database's password."""
    monkeypatch.setenv("HFPORT_DATABASE_URL", "jobs:s3cret@db.example.com:5432/jobs")  # the scheme forgotten
    with pytest.raises(SettingsError, match=r"HFPORT_DATABASE_URL \(its value not shown\): not a PostgreSQL URL \(no "
                                            r"scheme\): use postgresql://user:password@host:port/dbname") as e:
        ServerSettings(data_dir=tmp_path)
    assert "s3cret" not in str(e.value)
    monkeypatch.delenv("HFPORT_DATABASE_URL")
    with pytest.raises(SettingsError, match=r"database_url \(its value not shown\): not a PostgreSQL URL \(the "
                                            r"scheme 'mysql'\)") as e:
        ServerSettings(data_dir=tmp_path, database_url="mysql://jobs:s3cret@db/jobs")
    assert "s3cret" not in str(e.value)
    url = "postgres://jobs@db.example.com/jobs"
    assert ServerSettings(data_dir=tmp_path, database_url=url).store_target == url
    assert ServerSettings(data_dir=tmp_path).store_target == str(tmp_path / "hfport.db")


def test_a_retired_argument_names_its_replacement(tmp_path):
    with pytest.raises(SettingsError, match=r"job_lease_margin_s: no longer a setting: derived: "
                                            r"HFPORT_JOB_LEASE_S / 5"):
        ServerSettings(data_dir=tmp_path, job_lease_margin_s=5)
    with pytest.raises(SettingsError, match=r"lease_s: no longer a setting: HFPORT_JOB_LEASE_S"):
        ServerSettings(data_dir=tmp_path, lease_s=5)
    with pytest.raises(SettingsError, match=r"lease_seconds: not a setting; the settings: host, port, "):
        ServerSettings(data_dir=tmp_path, lease_seconds=5)


def test_whitespace_around_a_value_is_no_part_of_it(tmp_path, monkeypatch):
    """A token passed on with its file's newline (a mounted secret, an env file): it was taken whole, and since a
    Bearer header's value is stripped every request was refused. The same goes for a word setting, a bool and a path;
    nothing but whitespace is refused where a value must be."""
    monkeypatch.setenv("HFPORT_API_TOKEN", "s3cret\n")
    monkeypatch.setenv("HFPORT_ROLE", " api ")
    monkeypatch.setenv("HFPORT_AUTO_TRUNCATE", "false ")
    monkeypatch.setenv("HFPORT_HOST", " 127.0.0.1")
    monkeypatch.setenv("HFPORT_DATA_DIR", f"{tmp_path / 'd'} ")
    s = ServerSettings()
    assert (s.api_token, s.role, s.auto_truncate, s.host, s.data_dir) == ("s3cret", "api", False, "127.0.0.1",
                                                                          tmp_path / "d")
    assert ServerSettings.env_value("api_token") == "s3cret"  # one setting alone (a job process's store) alike
    with TestClient(create_app(s, run_worker=False)) as client:
        assert client.get("/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert client.get("/models", headers={"Authorization": "Bearer wrong"}).status_code == 403
    monkeypatch.setenv("HFPORT_API_TOKEN", " ")
    with pytest.raises(SettingsError, match=r"HFPORT_API_TOKEN \(its value not shown\): blank: set a value, or unset "
                                            r"the variable"):
        ServerSettings()


def test_serve_warns_of_a_variable_that_is_no_setting(tmp_path, monkeypatch):
    """A misspelt variable was ignored unseen, its setting left at the default."""
    monkeypatch.setattr(server.app, "serve", lambda settings, verbosity: None)
    monkeypatch.setenv("HFPORT_MAX_CONCURENT_JOBS", "4")
    monkeypatch.setenv("HFPORT_STORE_MAX_BYTE", "0")  # the library's, misspelt: the server knows those too
    result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert ("HFPORT_MAX_CONCURENT_JOBS is not a setting (did you mean HFPORT_MAX_CONCURRENT_JOBS?): ignored "
            "(docs/settings.md lists the settings)") in result.output, result.output
    assert "HFPORT_STORE_MAX_BYTE is not a setting (did you mean HFPORT_STORE_MAX_BYTES?)" in result.output


def test_serve_names_hfport_models_when_a_model_it_names_is_refused(tmp_path, monkeypatch):
    """The refusal named only --model, which a server started with HFPORT_MODELS was not given."""
    monkeypatch.setenv("HFPORT_MODELS", str(tmp_path / "nope"))
    result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path / "data")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"error: --model / HFPORT_MODELS '{tmp_path / 'nope'}': not a folder" in result.output, result.output


def test_a_job_process_gets_the_cache_dir_its_server_uses(tmp_path, monkeypatch):
    """A relative HFPORT_CACHE_DIR named another folder from a job process's working directory (the data dir): the
    jobs' int8 verdicts and hardware.json were not the server's."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HFPORT_CACHE_DIR", "cache")
    hfport.settings.reset()
    started = []
    monkeypatch.setattr(server.worker.subprocess, "Popen",
                        lambda cmd, **kw: started.append(kw) or types.SimpleNamespace(pid=2**22))
    settings = ServerSettings(data_dir=tmp_path / "data")
    settings.data_dir.mkdir()
    server.worker.Worker(settings, open_store(settings.store_target))._spawn({"id": "j1", "kind": "finetune",
                                                                             "attempts": 1})
    assert started[0]["cwd"] == str(tmp_path / "data")
    assert started[0]["env"]["HFPORT_CACHE_DIR"] == str(tmp_path / "cache")


def test_the_derived_settings_follow_their_source(tmp_path):
    s = ServerSettings(data_dir=tmp_path, job_lease_s=60, predict_max_inputs=10)
    assert s.job_heartbeat_s == 4 and s.lease_margin_s == 12 and s.job_start_grace_s == 60
    assert s.database_connect_timeout_s == 60 and s.batch_max_inputs == 20


def test_serve_refuses_a_bad_variable_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HFPORT_PORT", "http")
    result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert "error: invalid settings: HFPORT_PORT='http': input should be a valid integer" in result.output, \
        result.output


def test_serve_refuses_a_data_dir_that_is_a_file_in_one_line(tmp_path, monkeypatch):
    """It was met by the mkdir at start, a FileExistsError (NotADirectoryError below a file) traceback."""
    (tmp_path / "notes.txt").write_text("x")
    monkeypatch.setenv("HFPORT_DATA_DIR", str(tmp_path / "notes.txt"))
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert (f"error: invalid settings: HFPORT_DATA_DIR='{tmp_path / 'notes.txt'}': {tmp_path / 'notes.txt'} is a "
            "file, not a folder") in result.output, result.output
    result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path / "notes.txt" / "data")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert f"is a file, not a folder (so {tmp_path / 'notes.txt' / 'data'} cannot be one)" in result.output


@pytest.mark.parametrize(("variable", "value", "line"), [
    ("HFPORT_PORT", "abc", "error: invalid settings: HFPORT_PORT='abc': input should be a valid integer, unable to "
                           "parse string as an integer (accepted: int >= 0, <= 65535)"),
    ("HFPORT_JOB_LEASE_S", "-1", "error: invalid settings: HFPORT_JOB_LEASE_S='-1': input should be greater than 0 "
                                 "(accepted: float > 0)"),
    ("HFPORT_VERBOSITY", "loud", "error: HFPORT_VERBOSITY='loud': input should be 'quiet', 'normal', 'verbose', "
                                 "'debug' or 'trace' (accepted: quiet | normal | verbose | debug | trace | unset)"),
    ("HFPORT_MODELS", "nope", "error: --model / HFPORT_MODELS 'nope': not a folder"),
])
def test_python_m_server_refuses_a_bad_setting_as_hfport_serve_does(tmp_path, monkeypatch, capsys, variable, value,
                                                                    line):
    """`python -m server` (the server's own entry point) let the SettingsError out as a traceback."""
    monkeypatch.chdir(tmp_path)  # HFPORT_MODELS' 'nope' is looked for here
    monkeypatch.setenv("HFPORT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv(variable, value)
    hfport.settings.reset()
    result = CliRunner().invoke(app, ["serve"])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    refused = [text for text in result.output.splitlines() if text.startswith("error:")]
    assert len(refused) == 1 and refused[0].startswith(line), result.output
    hfport.settings.reset()
    with pytest.raises(SystemExit) as exited:
        server.__main__.main()
    assert exited.value.code == result.exit_code
    assert refused == [text for text in capsys.readouterr().err.splitlines() if text.startswith("error:")]


@pytest.fixture(params=["chmod", "simulated"])
def read_only(request, tmp_path, monkeypatch) -> Path:
    """A folder this process may not write in: chmod 0o500 (root ignores it: skipped there), or the OS's refusal
    simulated for it (mkdir and the write probe get EACCES), so that the refusal is tested as root (CI) too."""
    folder = tmp_path / "ro"
    folder.mkdir()
    if request.param == "chmod":
        if os.geteuid() == 0:
            pytest.skip("root ignores folder permissions (the 'simulated' case covers the refusal as root)")
        folder.chmod(0o500)
        request.addfinalizer(lambda: folder.chmod(0o700))
        return folder
    denied = lambda path: OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))  # noqa: E731
    mkdir, temporary = Path.mkdir, tempfile.TemporaryFile

    def refused_mkdir(self, *args, **kwargs):
        if self.parent == folder and not self.exists():
            raise denied(self)
        return mkdir(self, *args, **kwargs)

    def refused_file(*args, dir=None, **kwargs):  # noqa: A002 - tempfile's name
        if dir is not None and Path(dir) == folder:
            raise denied(Path(dir) / "tmpXXXX")
        return temporary(*args, dir=dir, **kwargs)

    monkeypatch.setattr(Path, "mkdir", refused_mkdir)
    monkeypatch.setattr(tempfile, "TemporaryFile", refused_file)
    return folder


@pytest.mark.parametrize("role", ["all", "worker"])
def test_serve_refuses_a_data_dir_it_cannot_make_or_write_in_one_line(read_only, role):
    """A data dir under a read-only parent was met by the mkdir at start (the store's open for a worker) as a
    PermissionError traceback; one that exists but is read-only, by the store's open or the first upload."""
    result = CliRunner().invoke(app, ["serve", "--role", role, "--data-dir", str(read_only / "data")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert (f"error: invalid settings: data_dir (HFPORT_DATA_DIR / --data-dir) '{read_only / 'data'}': cannot "
            f"create it: Permission denied: {read_only / 'data'}") in result.output, result.output
    result = CliRunner().invoke(app, ["serve", "--role", role, "--data-dir", str(read_only)])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert (f"error: invalid settings: data_dir (HFPORT_DATA_DIR / --data-dir) '{read_only}': cannot write in it: "
            "Permission denied") in result.output, result.output


@pytest.mark.parametrize("package", ["fastapi", "uvicorn"])
def test_serve_without_a_service_package_says_what_to_install_in_one_line(package, tmp_path, monkeypatch, capsys):
    """fastapi (imported with the app) or uvicorn (imported when HTTP is served), missing from an install made without
    hfport's dependencies (pip --no-deps, a trimmed image), was met as a traceback by `hfport serve`, `python -m
    server` and `hfport serve --help`. Now one line names the package and what installs it (hfport itself: the
    service's packages are its dependencies, no extra brings them)."""
    monkeypatch.setitem(sys.modules, package, None)  # `import fastapi` now raises ModuleNotFoundError
    if package == "fastapi":  # server.app imported again when serve runs, as in a fresh process (and fails: the
        monkeypatch.delitem(sys.modules, "server.app")  # package's attribute keeps the module other tests patch)
    said = (f"error: the service needs {package}, which is not installed (import of {package} halted; None in "
            "sys.modules); pip install hfport installs it with the service's other dependencies")
    result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path)], env={"COLUMNS": "400"})
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    assert said in result.output, result.output
    monkeypatch.setenv("HFPORT_DATA_DIR", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        server.__main__.main()  # python -m server
    assert exited.value.code == 1 and capsys.readouterr().err == said + "\n"
    if package == "fastapi":  # the settings listed in the help are read from the server's settings module
        monkeypatch.delitem(sys.modules, "server.settings")
        result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
        assert result.exit_code == 0 and said.removeprefix("error: ") in " ".join(result.output.split()), result.output


def test_the_docker_entrypoint_refuses_a_volume_it_cannot_write_in_one_line(read_only, monkeypatch, capsys):
    from server import entrypoint

    monkeypatch.setenv("HFPORT_API_TOKEN", "")  # none given: the entry point makes one in the data dir
    monkeypatch.setenv("HFPORT_DATA_DIR", str(read_only / "data"))
    with pytest.raises(SystemExit) as exited:
        entrypoint.main()
    assert exited.value.code == 1
    assert capsys.readouterr().err.startswith(f"error: invalid settings: data_dir (HFPORT_DATA_DIR / --data-dir) "
                                              f"'{read_only / 'data'}': cannot create it: Permission denied")


@pytest.mark.parametrize("case", ["a folder", "a dangling link", "unreadable", "empty"])
def test_the_docker_entrypoint_refuses_a_token_file_it_cannot_use_in_one_line(case, tmp_path, monkeypatch, capsys):
    """The data dir's api_token (the token the first start made) was met as a traceback when it could not be read: a
    folder or a dangling link in its place (IsADirectory/FileExistsError from the O_EXCL create), no permission to
    read it; an empty one was served as no token at all. Now one line names the variables, the path and the reason."""
    from server import entrypoint

    calls = []
    monkeypatch.setattr(entrypoint.os, "execvpe", lambda *a: calls.append(a))
    monkeypatch.setenv("HFPORT_API_TOKEN", "")  # none given: the entry point reads the data dir's
    monkeypatch.setenv("HFPORT_DATA_DIR", str(tmp_path))
    path = tmp_path / entrypoint.TOKEN_FILE
    if case == "a folder":
        path.mkdir()
    elif case == "a dangling link":
        path.symlink_to(tmp_path / "gone")
    elif case == "empty":
        path.write_text("\n")
    else:
        path.write_text("a-token\n")
        if os.geteuid() == 0:  # root reads any file: the OS's refusal, as a reader without permission gets it
            read_text = Path.read_text

            def refused(self, *args, **kwargs):
                if self == path:
                    raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
                return read_text(self, *args, **kwargs)

            monkeypatch.setattr(Path, "read_text", refused)
        else:
            path.chmod(0)
    with pytest.raises(SystemExit) as exited:
        entrypoint.main()
    assert exited.value.code == 1 and not calls
    reason = {"a folder": "cannot be read: Is a directory", "unreadable": "cannot be read: Permission denied",
              "a dangling link": "cannot be read: No such file or directory",
              "empty": "is empty: delete it to have a new one made, or set the variable"}[case]
    assert capsys.readouterr().err == (f"error: invalid settings: HFPORT_API_TOKEN is not set and the token kept for "
                                       f"it in data_dir (HFPORT_DATA_DIR) '{path}' {reason}\n")


def test_an_allowed_dir_that_is_no_folder_stops_the_server_naming_it(tmp_path, monkeypatch):
    """A mount path with a typo was accepted silently; every request into the folder meant was then a 403 listing the
    allowed dirs. docs/serving.md calls them folders that paths may point into: each must exist at start."""
    models = tmp_path / "models"
    models.mkdir()
    (tmp_path / "notes.txt").write_text("x")
    given = json.dumps([str(models), str(tmp_path / "modles"), str(tmp_path / "notes.txt")])
    monkeypatch.setenv("HFPORT_ALLOWED_DIRS", given)
    monkeypatch.setattr(server.app, "serve", lambda *args, **kwargs: None)  # accepted, it would have started
    result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path / "data")])
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    assert (f"error: invalid settings: HFPORT_ALLOWED_DIRS={given!r}: not a folder: {tmp_path / 'modles'} (does not "
            f"exist), {tmp_path / 'notes.txt'} (a file); each entry must be an existing folder (create it, mount it or "
            "correct the path)") in result.output, result.output
    assert not (tmp_path / "data").exists()  # refused before anything was made
    monkeypatch.delenv("HFPORT_ALLOWED_DIRS")
    # one inside the data dir may be missing: the data dir is made at start, and allows everything in it anyway
    inside = tmp_path / "data" / "sets"
    assert ServerSettings(data_dir=tmp_path / "data", allowed_dirs=[models, inside]).roots == [tmp_path / "data",
                                                                                               models, inside]
    with pytest.raises(SettingsError, match=rf"allowed_dirs=.*: not a folder: {tmp_path / 'modles'} \(does not "
                                            r"exist\)"):
        ServerSettings(data_dir=tmp_path / "data", allowed_dirs=[tmp_path / "modles"])


def test_a_setting_whose_values_are_names_takes_them_in_any_case(tmp_path, monkeypatch):
    """verbosity took any case, role and predict_dtype did not (HFPORT_ROLE=API was refused). A name is kept in its
    canonical spelling; a path, a token or a URL is taken as written; a name that is no choice is refused as given."""
    for variable, value in (("HFPORT_ROLE", "API"), ("HFPORT_PREDICT_DTYPE", "BF16"), ("HFPORT_DEVICE", "CPU"),
                            ("HFPORT_JOB_PROCESSES", "Auto"), ("HFPORT_VERBOSITY", "QUIET"),
                            ("HFPORT_API_TOKEN", "AbC"), ("HFPORT_WORKER_ID", "Host-1"),
                            ("HFPORT_DATABASE_URL", "postgresql://Jobs:PassWord@DB/Jobs")):
        monkeypatch.setenv(variable, value)
    s = ServerSettings(data_dir=tmp_path / "Data")
    assert (s.role, s.predict_dtype, s.device, s.job_processes) == ("api", "bfloat16", "cpu", "auto")
    assert (s.api_token, s.worker_id, s.database_url) == ("AbC", "Host-1", "postgresql://Jobs:PassWord@DB/Jobs")
    assert s.data_dir == tmp_path / "Data" and LibrarySettings().verbosity == "quiet"
    assert ServerSettings.env_value("role") == "api"  # one setting read alone, alike
    assert ServerSettings(data_dir=tmp_path, role="Worker").role == "worker"  # a flag (`serve --role Worker`) too
    monkeypatch.setenv("HFPORT_ROLE", "Boss")
    with pytest.raises(SettingsError, match=r"HFPORT_ROLE='Boss': input should be 'api', 'worker' or 'all'"):
        ServerSettings(data_dir=tmp_path)


def test_predict_dtype_takes_the_aliases_the_pipelines_take_and_the_docs_list_them(tmp_path):
    """fp32, bf16, fp16, half were accepted (case-sensitively) but docs/settings.md named none of them."""
    described = ServerSettings.model_fields["predict_dtype"].description  # docs/settings.md's (its staleness test)
    for alias, dtype in _DTYPES.items():
        canonical = str(dtype).removeprefix("torch.")
        assert re.search(rf"\b{alias}\b", described), (alias, described)
        for given in (alias, alias.upper()):
            assert ServerSettings(data_dir=tmp_path, predict_dtype=given).predict_dtype == canonical, given
    assert ServerSettings(data_dir=tmp_path, predict_dtype="torch.bfloat16").predict_dtype == "bfloat16"
    assert ServerSettings(data_dir=tmp_path, predict_dtype="Auto-INT8").predict_dtype == "auto-int8"

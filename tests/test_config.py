"""Config loading and checking (train.py: load_config, check_value, main's error path).

No test here runs a training: every main() call gets a config that fails to load."""
import os
import subprocess
import sys

import pytest

import train
from config import DEFAULTS, ConfigError, check_value, load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def write(tmp_path):
    def _write(text, name="c.yaml"):
        path = tmp_path / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
        return str(path)
    return _write


def error_of(path, overrides=()):
    with pytest.raises(ConfigError) as e:
        load_config(path, overrides)
    return str(e.value)


# ----------------------------------------------------------------------------- defaults

def test_empty_file_gives_the_defaults(write):
    assert load_config(write("")) == DEFAULTS


def test_defaults_are_filled_in(write):
    cfg = load_config(write("rl_steps: 5\nenv_mode: real\n"))
    assert cfg["rl_steps"] == 5 and cfg["env_mode"] == "real"
    assert set(cfg) == set(DEFAULTS)
    assert cfg["lr"] == 1e-4 and cfg["group_size"] == 8 and cfg["scale_std"] is False
    assert {k: v for k, v in cfg.items() if k not in ("rl_steps", "env_mode")} == \
        {k: v for k, v in DEFAULTS.items() if k not in ("rl_steps", "env_mode")}
    assert DEFAULTS["rl_steps"] == 200                     # DEFAULTS itself is not mutated


def test_repo_small_yaml_loads():
    cfg = load_config(os.path.join(REPO, "small.yaml"))
    assert cfg["out_dir"] == "out/small" and cfg["lr"] == 0.0001 and cfg["sft_lr"] == 0.001


def test_world_sizes_match_train_defaults():
    # test_world.py writes these sizes out to avoid importing torch
    assert (DEFAULTS["n_logged"], DEFAULTS["n_new_logged"], DEFAULTS["n_rl_tasks"],
            DEFAULTS["n_test"]) == (3000, 20, 4000, 500)


# ----------------------------------------------------------------------------- unknown keys

def test_unknown_key_names_it_and_suggests_the_closest(write):
    msg = error_of(write("rl_step: 10\n"))
    assert "'rl_step'" in msg
    assert "did you mean 'rl_steps'?" in msg


def test_unknown_key_without_a_close_match(write):
    msg = error_of(write("zzzzzzzz: 1\n"))
    assert "'zzzzzzzz'" in msg and "did you mean" not in msg


@pytest.mark.parametrize("text", ["1: 2\n", "yes: 1\n"])
def test_non_string_key_is_a_config_error(write, text):
    error_of(write(text))


# ----------------------------------------------------------------------------- types

@pytest.mark.parametrize("text, key", [
    ("rl_steps: ten\n", "rl_steps"),
    ("rl_steps: '5'\n", "rl_steps"),
    ("rl_steps: 2.5\n", "rl_steps"),
    ("rl_steps: true\n", "rl_steps"),
    ("scale_std: 1\n", "scale_std"),
    ("scale_std: 'yes please'\n", "scale_std"),
    ("lr: true\n", "lr"),
    ("lr: fast\n", "lr"),
    ("out_dir: 5\n", "out_dir"),
    ("out_dir:\n", "out_dir"),
    ("group_size: [8]\n", "group_size"),
])
def test_wrong_type_names_the_key(write, text, key):
    msg = error_of(write(text))
    assert f"'{key}'" in msg


@pytest.mark.parametrize("text, key, value", [
    ("lr: 1\n", "lr", 1.0), ("top_p: 1\n", "top_p", 1.0), ("dual_clip: 3\n", "dual_clip", 3.0),
    ("kl_coef: 0\n", "kl_coef", 0.0), ("temperature: 2\n", "temperature", 2.0),
])
def test_ints_are_accepted_for_float_keys(write, text, key, value):
    cfg = load_config(write(text))
    assert cfg[key] == value and type(cfg[key]) is float


def test_check_value_directly():
    assert check_value("rl_steps", 5) == 5
    v = check_value("lr", 2)
    assert v == 2.0 and type(v) is float
    with pytest.raises(ConfigError, match="'scale_std'"):
        check_value("scale_std", 1)


def test_scientific_notation_is_a_float(write):
    assert load_config(write("lr: 1e-4\n"))["lr"] == 0.0001
    assert load_config(write(""), ["--lr=1e-4"])["lr"] == 0.0001


# ----------------------------------------------------------------------------- ranges and choices

@pytest.mark.parametrize("text, key", [
    ("lr: -1\n", "lr"), ("lr: 0\n", "lr"), ("sft_lr: 0\n", "sft_lr"),
    ("top_p: 0\n", "top_p"), ("top_p: 1.5\n", "top_p"),
    ("coverage: 1.5\n", "coverage"), ("coverage: 0\n", "coverage"), ("coverage: -0.5\n", "coverage"),
    ("min_fidelity: 1.5\n", "min_fidelity"), ("min_fidelity: -0.1\n", "min_fidelity"),
    ("env_mode: dream\n", "env_mode"), ("device: tpu\n", "device"),
    ("rl_steps: -1\n", "rl_steps"), ("group_size: 0\n", "group_size"),
    ("eps_low: -0.1\n", "eps_low"), ("kl_coef: -1\n", "kl_coef"),
    ("dual_clip: 1\n", "dual_clip"), ("dual_clip: 0.5\n", "dual_clip"),
])
def test_out_of_range_names_the_key(write, text, key):
    msg = error_of(write(text))
    assert f"'{key}'" in msg


@pytest.mark.parametrize("text", [
    "top_p: 1\n", "coverage: 1.0\n", "coverage: 0.5\n", "min_fidelity: 0\n", "min_fidelity: 1\n",
    "rl_steps: 0\n", "sft_steps: 0\n", "kl_coef: 0.0\n", "eps_low: 0\n", "dual_clip: 1.5\n",
    "env_mode: frozen\n", "env_mode: real\n", "device: cpu\n", "scale_std: true\n",
])
def test_boundaries_are_accepted(write, text):
    load_config(write(text))


def test_n_embd_must_divide_by_n_head(write):
    msg = error_of(write("n_embd: 130\nn_head: 4\n"))
    assert "n_embd" in msg and "n_head" in msg


# ----------------------------------------------------------------------------- the file itself

def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.yaml")
    msg = error_of(path)
    assert "not found" in msg and path in msg


def test_a_directory_is_not_a_config(tmp_path):
    assert "not found" in error_of(str(tmp_path))


@pytest.mark.parametrize("text, line", [
    ("rl_steps: 5\nlr: 0.1\n  seed: 3\n", 3),
    ("rl_steps: 5\nlr: [1,\n  2\nseed: : 3\n", 4),
    ("out_dir: 'unclosed\n", 2),
])
def test_invalid_yaml_names_the_line(write, text, line):
    path = write(text)
    msg = error_of(path)
    assert msg.startswith(f"invalid YAML in {path} at line {line}:")


@pytest.mark.parametrize("text", ["- rl_steps\n- 5\n", "hello\n", "5\n"])
def test_non_mapping_file(write, text):
    assert "flat mapping" in error_of(write(text))


@pytest.mark.parametrize("text", ["[]\n", "0\n", "false\n"])
def test_falsy_non_mapping_file(write, text):
    assert "flat mapping" in error_of(write(text))


def test_non_utf8_file_is_a_config_error(write):
    error_of(write(b"\x80\x81: 1\n"))


# ----------------------------------------------------------------------------- overrides

def test_overrides(write):
    path = write("rl_steps: 3\n")
    assert load_config(path)["rl_steps"] == 3
    assert load_config(path, ["--rl_steps=5"])["rl_steps"] == 5      # override beats the file
    assert load_config(path, ["--rl_steps=5", "--rl_steps=7"])["rl_steps"] == 7
    cfg = load_config(path, ["--env_mode=real", "--lr=0.5", "--scale_std=true", "--top_p=1",
                             "--out_dir=out/x=y"])
    assert cfg["env_mode"] == "real" and cfg["lr"] == 0.5 and cfg["scale_std"] is True
    assert cfg["top_p"] == 1.0 and type(cfg["top_p"]) is float
    assert cfg["out_dir"] == "out/x=y"                               # split on the first '='


@pytest.mark.parametrize("overrides, needle", [
    (["--nope=1"], "'nope'"),
    (["--rl_step=5"], "did you mean 'rl_steps'?"),
    (["--rl_steps=ten"], "'rl_steps'"),
    (["--scale_std=1"], "'scale_std'"),
    (["--coverage=1.5"], "'coverage'"),
    (["--top_p=0"], "'top_p'"),
    (["--env_mode=dream"], "'env_mode'"),
    (["--lr=-1"], "'lr'"),
    (["rl_steps=5"], "'rl_steps=5'"),
    (["-rl_steps=5"], "'-rl_steps=5'"),
    (["--rl_steps"], "'--rl_steps'"),
    (["--rl_steps=5", "--nope=1"], "'nope'"),
])
def test_bad_overrides(write, overrides, needle):
    assert needle in error_of(write(""), overrides)


# ----------------------------------------------------------------------------- main's error path

def stderr_lines(capsys):
    captured = capsys.readouterr()
    assert captured.out == ""
    return captured.err.splitlines()


@pytest.mark.parametrize("how", ["separate", "equals"])
def test_main_bad_key_in_file(write, capsys, how):
    path = write("rl_step: 3\n")
    argv = ["--config", path] if how == "separate" else [f"--config={path}"]
    assert train.main(argv) == 2
    lines = stderr_lines(capsys)
    assert len(lines) == 1
    assert lines[0].startswith("error:") and "'rl_step'" in lines[0] and "rl_steps" in lines[0]


def test_main_bad_override(write, capsys):
    path = write("")
    assert train.main(["--rl_steps=1", "--config", path, "--nope=1"]) == 2
    lines = stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error:") and "'nope'" in lines[0]


def test_main_missing_file(tmp_path, capsys):
    assert train.main(["--config", str(tmp_path / "nope.yaml")]) == 2
    lines = stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error:") and "not found" in lines[0]


def test_main_invalid_yaml(write, capsys):
    assert train.main(["--config", write("a: 1\nb: 2\n  c: 3\n")]) == 2
    lines = stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error:") and "line 3" in lines[0]


def test_main_without_config_prints_usage(capsys):
    assert train.main([]) == 2
    lines = stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("usage:")


def test_main_config_without_a_path(capsys):
    assert train.main(["--config"]) == 2


def test_cli_bad_config_exits_2_with_one_line(write):
    path = write("rl_step: 3\n")
    proc = subprocess.run([sys.executable, "train.py", "--config", path], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: unknown config key 'rl_step'")
    assert proc.stdout == ""


def test_every_shipped_config_loads():
    import glob
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [os.path.join(root, "small.yaml")] + sorted(glob.glob(os.path.join(root, "configs", "*.yaml")))
    assert len(paths) >= 8
    for path in paths:
        cfg = load_config(path)
        if cfg["format"] == "plain" and cfg["model"] == "tiny":   # the toy experiment arms
            assert cfg["n_new_logged"] == 48 and cfg["rl_steps"] in (0, 200), path

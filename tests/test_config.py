"""Config loading and checking (machinery/config.py: load_config and its bases, check_value; train.py:
main's error path).

No test here runs a training: every main() call gets a config that fails to load."""
import os
import subprocess
import sys

import pytest

from machinery import config
import train
from machinery.config import DEFAULTS, ConfigError, check_value, load_config

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


# ----------------------------------------------------------------------------- bases

def test_a_chain_of_two_bases(write):
    write("rl_steps: 5\nlr: 0.5\nseed: 7\n", "grand.yaml")
    write("base: grand.yaml\nlr: 0.25\nenv_mode: real\n", "parent.yaml")
    child = write("base: parent.yaml\nseed: 9\n", "child.yaml")
    cfg = load_config(child)
    assert cfg == {**DEFAULTS, "rl_steps": 5, "lr": 0.25, "env_mode": "real", "seed": 9}
    assert "base" not in cfg and list(cfg) == list(DEFAULTS)


def test_the_child_wins_over_its_base(write):
    write("rl_steps: 5\nenv_mode: frozen\n", "b.yaml")
    cfg = load_config(write("base: b.yaml\nrl_steps: 6\n"))
    assert cfg["rl_steps"] == 6 and cfg["env_mode"] == "frozen"
    assert load_config(write("base: b.yaml\n"))["rl_steps"] == 5            # a file of just a base


def test_overrides_win_over_file_and_base(write):
    write("rl_steps: 5\nseed: 3\n", "b.yaml")
    cfg = load_config(write("base: b.yaml\nrl_steps: 6\n"), ["--rl_steps=7", "--seed=4"])
    assert cfg["rl_steps"] == 7 and cfg["seed"] == 4


def test_a_base_is_relative_to_the_folder_of_the_file_naming_it(tmp_path, monkeypatch):
    (tmp_path / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "top.yaml").write_text("rl_steps: 3\n")
    (tmp_path / "sub" / "mid.yaml").write_text("base: ../top.yaml\nseed: 5\n")
    (tmp_path / "sub" / "deeper" / "leaf.yaml").write_text("base: ../mid.yaml\n")
    monkeypatch.chdir(tmp_path / "sub")               # not the folder of any base's naming file
    cfg = load_config("deeper/leaf.yaml")
    assert cfg["rl_steps"] == 3 and cfg["seed"] == 5
    assert load_config(str(tmp_path / "sub" / "deeper" / "leaf.yaml")) == cfg


def test_a_missing_base_names_it_and_its_naming_file(write, tmp_path):
    child = write("base: nope.yaml\n", "child.yaml")
    msg = error_of(child)
    assert "base file not found" in msg and str(tmp_path / "nope.yaml") in msg and child in msg
    assert "\n" not in msg


def test_a_missing_base_further_down_the_chain(write, tmp_path):
    parent = write("base: gone.yaml\n", "parent.yaml")
    msg = error_of(write("base: parent.yaml\n", "child.yaml"))
    assert str(tmp_path / "gone.yaml") in msg and f"the base of {parent}" in msg


@pytest.mark.parametrize("files, start", [
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: a.yaml\n"}, "a.yaml"),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: c.yaml\n", "c.yaml": "base: a.yaml\n"}, "a.yaml"),
    ({"a.yaml": "base: a.yaml\n"}, "a.yaml"),
    ({"a.yaml": "base: ./sub/../a.yaml\n"}, "a.yaml"),        # the same file by another name
])
def test_a_cycle_of_bases(write, tmp_path, files, start):
    (tmp_path / "sub").mkdir()
    for name, text in files.items():
        write(text, name)
    msg = error_of(str(tmp_path / start))
    assert "cycle of bases" in msg and str(tmp_path / "a.yaml") in msg and "\n" not in msg


def test_a_diamond_is_not_a_cycle(write):
    write("rl_steps: 3\n", "root.yaml")
    write("base: root.yaml\nseed: 4\n", "mid.yaml")
    assert load_config(write("base: mid.yaml\n"))["rl_steps"] == 3
    assert load_config(write("base: root.yaml\n", "other.yaml"))["rl_steps"] == 3


@pytest.mark.parametrize("text", ["base: 5\n", "base:\n", "base: ''\n", "base: [a.yaml]\n",
                                  "base: true\n"])
def test_base_must_be_a_path(write, text):
    path = write(text)
    msg = error_of(path)
    assert "'base'" in msg and path in msg


def test_a_bad_key_in_a_base_names_the_base(write):
    grand = write("rl_step: 5\n", "grand.yaml")
    parent = write("base: grand.yaml\nseed: 1\n", "parent.yaml")
    child = write("base: parent.yaml\n", "child.yaml")
    msg = error_of(child)
    assert f"in {grand} (the base of {parent})" in msg
    assert "'rl_step'" in msg and "did you mean 'rl_steps'?" in msg
    assert f"in {grand} (the base of {parent})" in error_of(parent)       # loaded directly: the same


@pytest.mark.parametrize("text, key", [("lr: fast\n", "'lr'"), ("coverage: 2\n", "'coverage'"),
                                       ("env_mode: dream\n", "'env_mode'")])
def test_a_bad_value_in_a_base_names_the_base(write, text, key):
    base = write(text, "b.yaml")
    child = write("base: b.yaml\n", "child.yaml")
    msg = error_of(child)
    assert f"in {base} (the base of {child})" in msg and key in msg


def test_a_bad_key_in_the_child_does_not_blame_the_base(write):
    write("rl_steps: 5\n", "b.yaml")
    msg = error_of(write("base: b.yaml\nrl_step: 5\n"))
    assert msg.startswith("unknown config key 'rl_step'") and "b.yaml" not in msg


@pytest.mark.parametrize("text, needle", [("a: 1\nb: 2\n  c: 3\n", "at line 3"),
                                          ("- 1\n", "flat mapping")])
def test_a_broken_base_file_names_the_base(write, text, needle):
    base = write(text, "b.yaml")
    msg = error_of(write("base: b.yaml\n", "child.yaml"))
    assert base in msg and needle in msg


def test_the_checks_across_keys_apply_to_the_final_config(write):
    write("n_embd: 130\n", "b.yaml")                    # not runnable by itself (130 % 4)
    assert load_config(write("base: b.yaml\nn_head: 5\n"))["n_embd"] == 130
    assert "n_head" in error_of(write("base: b.yaml\n", "c2.yaml"))


@pytest.mark.parametrize("arg", ["--base=other.yaml", "--base=", "--base=../small.yaml"])
def test_base_is_not_an_override(write, arg):
    write("rl_steps: 5\n", "other.yaml")
    msg = error_of(write(""), [arg])
    assert "base" in msg and "override" in msg and "\n" not in msg


def test_main_missing_base_is_one_line(write, capsys, tmp_path):
    assert train.main(["--config", write("base: nope.yaml\n")]) == 2
    lines = stderr_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith("error: base file not found")
    assert str(tmp_path / "nope.yaml") in lines[0]


def test_the_saved_resolved_config_reloads_without_its_base(write, tmp_path):
    """A run saves yaml.safe_dump(cfg) as out_dir/config.yaml; evaluate.py and --resume reload it."""
    import yaml
    write("rl_steps: 5\nlr: 0.5\n", "b.yaml")
    cfg = load_config(write("base: b.yaml\nseed: 3\n"))
    saved = tmp_path / "saved" / "config.yaml"
    saved.parent.mkdir()
    saved.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert "base" not in saved.read_text()
    assert load_config(str(saved)) == cfg


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
        if cfg["format"] == "plain" and cfg["model"] == "tiny" and cfg["world"] == "toy":   # the toy experiment arms
            assert cfg["n_new_logged"] == 48 and cfg["rl_steps"] in (0, 200), path
        elif cfg["world"] == "uncertain":      # its own warm start (docs/uncertain.md); the arms add --rl_steps=200
            assert (cfg["n_new_logged"], cfg["rl_steps"], cfg["uncertain_items"]) == (600, 0, 8), path


def shipped(name):
    return load_config(os.path.join(REPO, name))


def differing(a, b):
    return {k for k in a if a[k] != b[k]}


def test_shipped_deltas_differ_in_the_keys_they_name():
    """The arms are small deltas (base: ...): these sets are computed by hand from the files."""
    small = shipped("small.yaml")
    assert differing(shipped("configs/real.yaml"), small) == {"env_mode", "out_dir", "eval_every"}
    assert differing(shipped("configs/rehearse.yaml"), small) == {"out_dir", "eval_every"}
    rehearse = shipped("configs/rehearse.yaml")
    assert differing(shipped("configs/coverage.yaml"), rehearse) == {"out_dir", "coverage", "min_fidelity"}
    assert differing(shipped("configs/guard_kl.yaml"), rehearse) == {"out_dir", "kl_rehearse_coef"}
    separate = shipped("configs/separate.yaml")
    assert differing(separate, rehearse) == {"out_dir", "rehearsal_context", "advantage_groups"}
    assert differing(shipped("configs/guard_rolewise.yaml"), separate) == {"out_dir", "advantage_groups"}
    assert differing(shipped("configs/guard_ground.yaml"), separate) == {"out_dir", "grounding_examples"}
    assert differing(shipped("configs/guard_all.yaml"), separate) == {
        "out_dir", "grounding_examples", "advantage_groups", "kl_rehearse_coef", "rehearse_check"}
    assert differing(shipped("configs/warmstart_ground.yaml"), shipped("configs/warmstart.yaml")) == {
        "out_dir", "rehearsal_context", "advantage_groups", "grounding_examples"}


def test_shipped_small_yaml_is_a_short_delta():
    import yaml
    with open(os.path.join(REPO, "small.yaml")) as f:
        keys = yaml.safe_load(f)
    assert "base" not in keys and len(keys) <= 14
    assert shipped("small.yaml") == {**DEFAULTS, **keys}
    # the demo runs one thread a process and replays nothing during RL (DEFAULTS: every core, replay on)
    assert (keys["threads"], keys["replay_fidelity"]) == (1, False) != (DEFAULTS["threads"], DEFAULTS["replay_fidelity"])


def test_command_line_splits_path_overrides_and_flags():
    assert config.command_line(["--config", "a.yaml", "--rl_steps=3", "--resume"]) == \
        ("a.yaml", ["--rl_steps=3"], {"--resume": True, "--overwrite": False, "--debug": False})
    assert config.command_line(["--seed=2", "--config=b.yaml", "--debug"]) == \
        ("b.yaml", ["--seed=2"], {"--resume": False, "--overwrite": False, "--debug": True})
    for argv, message in ((["--config"], "--config needs a path"), (["--config="], "--config needs a path"),
                          (["--config", "a.yaml", "--resume", "--overwrite"], "give one")):
        with pytest.raises(config.ConfigError, match=message):
            config.command_line(argv)

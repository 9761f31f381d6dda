import os
import subprocess
import sys

import pytest

from configurator import configure, require


def defaults():
    return {"lr": 1e-6, "steps": 300, "roc": True, "run_dir": "out/x", "path": None, "__doc__": "doc"}


def run(argv, capsys):
    g = defaults()
    with pytest.raises(SystemExit) as e:
        configure(g, argv)
    return e.value.code, capsys.readouterr().err.strip().splitlines()


def test_overrides_are_typed_and_echoed(capsys):
    g = defaults()
    cfg = configure(g, ["--lr=3e-4", "--steps=5", "--roc=false", "--run_dir=out/y", "--path=a/b"])
    assert cfg == {"lr": 3e-4, "steps": 5, "roc": False, "run_dir": "out/y", "path": "a/b"}
    assert g["steps"] == 5
    assert "override: lr = 0.0003" in capsys.readouterr().out
    assert configure(defaults(), ["--lr=1"])["lr"] == 1.0  # an int where a float is expected is fine


def test_unknown_key_names_the_closest(capsys):
    code, err = run(["--stpes=3"], capsys)
    assert code == 2 and err == ["config error: command line: unknown key 'stpes' (did you mean 'steps'?)"]


def test_malformed_value_names_key(capsys):
    code, err = run(["--steps=3.5"], capsys)
    assert code == 2 and len(err) == 1 and "'steps' must be int" in err[0]
    code, err = run(["--roc=maybe"], capsys)
    assert code == 2 and "'roc' must be bool" in err[0]


def test_a_value_outside_its_range_names_the_rule_and_its_keys(capsys):
    g = configure(defaults(), ["--steps=0", "--lr=1e-5"])
    require(g, "steps >= 0", "0 <= lr < 1")  # all hold: nothing happens
    for rule, says in [("steps >= 1", "need steps >= 1, got steps = 0"),
                       ("not roc or steps > lr", "need not roc or steps > lr, got roc = True, steps = 0, lr = 1e-05"),
                       # a quoted value's words are not keys, even where a key has that name
                       ("roc == 'steps'", "need roc == 'steps', got roc = True")]:
        with pytest.raises(SystemExit) as e:
            require(g, "lr >= 0", rule)
        assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [f"config error: {says}"]


def test_config_file(tmp_path, capsys):
    good = tmp_path / "good.py"
    good.write_text("# a comment\nsteps = 7\nlr = 2e-5\n")
    assert configure(defaults(), [str(good), "--steps=9"])["steps"] == 9
    bad = tmp_path / "bad.py"
    bad.write_text("steps = 7\nlr = = 2\n")
    code, err = run([str(bad)], capsys)
    assert code == 2 and err == [f"config error: {bad}:2: invalid syntax"]
    typo = tmp_path / "typo.py"
    typo.write_text("step = 7\n")
    code, err = run([str(typo)], capsys)
    assert err == [f"config error: {typo}: unknown key 'step' (did you mean 'steps'?)"]
    code, err = run([str(tmp_path / "missing.py")], capsys)
    assert "not found" in err[0]
    # a value of a type no key has (a dict, a set) is refused, not passed over: the run used the default
    for text, says in [("run_dir = {'a': 1}\n", "'run_dir' must be str"),
                       ("stpes = {7}\n", "unknown key 'stpes'")]:
        typed = tmp_path / "typed.py"
        typed.write_text(text)
        code, err = run([str(typed)], capsys)
        assert code == 2 and len(err) == 1 and says in err[0], err
    # what a config file imports or defines to compute its values is no key
    helpers = tmp_path / "helpers.py"
    helpers.write_text("import math\n\n\ndef half(x):\n    return x / 2\n\n\nlr = half(math.e)\n")
    assert configure(defaults(), [str(helpers)])["lr"] == 1.3591409142295225


def test_help_lists_keys_defaults_and_types():
    script = "from configurator import configure\nlr = 1e-6\nsteps = 3\ncfg = configure(globals())\n"
    out = subprocess.run([sys.executable, "-c", script, "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "--lr=1e-06  (float)" in out.stdout and "--steps=3  (int)" in out.stdout


def test_help_prints_the_comment_beside_each_default(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "from configurator import configure\n"
        "lr = 1e-6  # the learning rate\n"
        "tag = '# not a comment'\n"  # a # inside a string
        "cap = 4  # a long comment that\n"
        "#         goes on below\n"
        "# a section header, not part of cap's comment\n"
        "steps = 3\n"
        "cfg = configure(globals())\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root})
    assert out.returncode == 0, out.stderr
    lines = {line.split("=")[0].strip(): line for line in out.stdout.splitlines() if line.startswith("  --")}
    assert lines["--lr"].endswith("(float)  the learning rate")
    assert lines["--tag"].endswith("(str)") and lines["--steps"].endswith("(int)")
    assert lines["--cap"].endswith("(int)  a long comment that goes on below")

"""
Config files and command-line overrides, nanoGPT style but strict.

An entry script declares its defaults as plain module globals, then calls

    cfg = configure(globals())

which reads sys.argv: every argument without `--` is a python config file of plain assignments
(applied in order), every `--key=value` overrides one key. Values are type-checked against the
defaults, an unknown key is an error naming the closest valid key, every override is echoed, and
`--help` lists keys, defaults, types and the comment beside each default. Any mistake exits with one
line that names it; so does a value outside the ranges an entry script states with

    require(globals(), "lr >= 0", "0 < top_p <= 1", ...)
"""
import ast
import difflib
import os
import re
import sys
import tokenize
import types

SIMPLE = (bool, int, float, str, tuple, list, type(None))


def fail(msg):
    print(f"config error: {msg}", file=sys.stderr)
    sys.exit(2)


def check(key, value, defaults, where):
    """Return value converted to the type of the default, or exit naming the key."""
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=1)
        fail(f"{where}: unknown key '{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
    default = defaults[key]
    # no default to match, no value, or a value of the default's own type: as it is
    if default is None or value is None or type(value) is type(default):
        return value
    # an int where a float is expected becomes one (a bool is no int here: type, not isinstance)
    if isinstance(default, float) and type(value) is int:
        return float(value)
    # a list for a tuple, or a tuple for a list
    if isinstance(default, (list, tuple)) and isinstance(value, (list, tuple)):
        return type(default)(value)
    fail(f"{where}: '{key}' must be {type(default).__name__} (default {default!r}), got {value!r}")


def require(g, *rules):
    """Exit naming the keys and their values when a rule, a Python expression over the config keys of g (a
    script's globals: "0 < top_p <= 1"), is false. The entry scripts state their settings' ranges this way, so
    a value the run would misuse quietly (a negative KL coefficient) or fail on late (after a step's rollouts,
    minutes into a 64-GPU run) stops it before anything starts."""
    for rule in rules:
        if not eval(rule, g):
            # the keys the rule names, in order, each once: its names, not the words of its quoted values (a
            # quoted value matches the pattern's first branch, whose group 1 is then empty, and no key)
            keys = [key for key in dict.fromkeys(re.findall(r"'[^']*'|([A-Za-z_]\w*)", rule)) if key in g]
            fail(f"need {rule}, got " + ", ".join(f"{key} = {g[key]!r}" for key in keys))


def parse_value(text):
    """`--lr=1e-4` -> 1e-4, `--name=run1` -> 'run1', `--flag=true` -> True."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def key_comments(path):
    """{key: the comment beside its default} in a script's `key = value  # comment` lines (the first assignment
    of each key), each with the comment-only lines right below it that continue it, indented after their #
    (`#      more`), for --help."""
    tokens = tokenize.generate_tokens(open(path, encoding="utf-8").readline)
    # {line number: its comment token}, whose .line is the whole line it sits on
    comments = {tok.start[0]: tok for tok in tokens if tok.type == tokenize.COMMENT}
    out = {}
    for lineno, comment in comments.items():
        assigned = re.match(r"\s*([A-Za-z_]\w*)\s*=[^=]", comment.line)
        if not assigned or assigned[1] in out:
            continue
        text = comment.string[1:].strip()
        # the comment-only lines right below that continue it
        while lineno + 1 in comments and comments[lineno + 1].line.lstrip().startswith("#  "):
            lineno += 1
            text += " " + comments[lineno].string[1:].strip()
        out[assigned[1]] = text
    return out


def configure(g, argv=None):
    """Apply config files and --key=value overrides from argv to the dict g (a module's globals)."""
    argv = sys.argv[1:] if argv is None else argv
    # the config keys g holds: its public plain values, whose types the overrides must match
    defaults = {key: value for key, value in g.items()
                if not key.startswith("_") and isinstance(value, SIMPLE)}
    # the values are echoed by rank 0 only (RANK is unset without torchrun)
    verbose = os.environ.get("RANK", "0") == "0"
    if "--help" in argv or "-h" in argv:
        print((g.get("__doc__") or "").strip() + "\n\nconfig keys (override with --key=value):")
        comments = key_comments(g["__file__"]) if "__file__" in g else {}
        for key, default in defaults.items():
            print(f"  --{key}={default!r}  ({type(default).__name__})"
                  + (f"  {comments[key]}" if key in comments else ""))
        sys.exit(0)
    for arg in argv:
        # what the argument assigns: an override its one key, a config file the plain values it leaves behind
        if arg.startswith("--"):
            if "=" not in arg:
                fail(f"'{arg}' must look like --key=value")
            key, text = arg[2:].split("=", 1)
            where = "command line"
            label = "override"
            assigned = {key: parse_value(text)}
        else:
            if not os.path.isfile(arg):
                fail(f"config file '{arg}' not found")
            scope = {}
            try:
                exec(compile(open(arg).read(), arg, "exec"), scope)
            except SyntaxError as e:
                fail(f"{arg}:{e.lineno}: {e.msg}")
            except Exception as e:  # a config that raises while running, e.g. a NameError
                # the traceback entry of the config file itself, below this one
                tb = e.__traceback__.tb_next
                line = tb.tb_lineno if tb else "?"
                fail(f"{arg}:{line}: {type(e).__name__}: {e}")
            where = label = arg
            # every public name but the modules and functions it uses: a value of any other type (a dict) is
            # refused by check, not passed over
            assigned = {key: value for key, value in scope.items() if not key.startswith("_")
                        and not callable(value) and not isinstance(value, types.ModuleType)}
        # each one checked against its default (an unknown key or a wrong type exits, naming it), then echoed
        for key, value in assigned.items():
            g[key] = check(key, value, defaults, where)
            if verbose:
                print(f"{label}: {key} = {g[key]!r}")
    return {k: g[k] for k in defaults}

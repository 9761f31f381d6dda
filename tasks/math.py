"""
The rStar2-Agent math task, the default (`task = "tasks/math.py"`): the released prompt with its one Python
tool, and the 0/1 math-verify reward of the paper. Token for token what the release's model sees. The reward's
whole rule is here, in reward(); grading.py runs it under its bounds (and scores a trajectory cut by the
budget 0 before any task sees it, unless score_truncated: grading.Grader.grade).

A task is one file like this one, named by the `task` key of train_rl.py and eval.py. It defines:

    COLUMNS        the JSONL columns every row must have, with their types (a missing one, or one of
                   another type, stops the run, naming file and line)
    TOOLS          its tool table, name -> agent.Tool (schema + run); {} offers no tool
    prompt(row)    the whole prompt text of a data row (agent.prompt_text renders the protocol's)
    predict(turns) the prediction read from the sampled turns (maj@k votes on it unless vote(); None: none)
    grade(row, pred, turns, grader, trajectory) -> (reward in [0, 1], correct): reward is what training uses,
                   correct what avg@k / pass@k / maj@k and the metrics count. It runs on grading.Grader's threads,
                   under its bounds; the grader offers what a grade may need: grader.run_in_helper (a function
                   in a helper process, killed when late), grader.refuses (the size bound), grader.sandbox (the
                   sandbox pool); trajectory.tool_calls holds the agent.CallRecord of each call (tool,
                   arguments, status, output) and trajectory.environment the environment's final state.
and may define
    environment(row)  one new object per trajectory, the state its tools share (a game, a session): the tools
                   marked agent.Tool(stateful=True) run on it, grade() reads it, its close() runs when the
                   trajectory ends however it ends (tasks/gridworld.py is the worked example); with a
                   respond(turn_text) method it answers a turn without a tool call: its string is the next
                   user turn, None ends the episode (tasks/guess.py: a referee); called on the decode loop,
                   so a reply that takes time comes as a Future, bounded like a tool call
    vote(row, pred, trajectory)  what maj@k groups the sample by (a hashable key; None: no vote), made with
                   the grade; without it, the pred (tasks/code.py votes on the program, not its text)

`row` is the whole JSONL row: every column reaches prompt() and grade().
"""
import re

import agent
import grading

# the columns and their types: answers are compared as text, so a JSON number is refused (it is almost always
# a mistake: 0.333 for 1/3)
COLUMNS = {"question": str, "answer": str}
TOOLS = agent.PYTHON_TOOLS

_ZERO_WIDTH = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff"))
# a thousands separator: a space of any kind, \, \; \: "\ " ~ or {,} between a digit and a group of three
_SEPARATOR_RE = re.compile(r"(?<=\d)(?:\s|\\[,;: ]|~|\{,\})(?=\d{3}(?!\d))")
# one {...} argument of a command, with one level of braces inside it
_ARG = r"\{(?:[^{}]|\{[^{}]*\})*\}"
# the relations math-verify reads one side of. Its parser (latex2sympy2_extended) takes the right side of
# = == := \equiv and ≡ ≟ ≔ ≒ ...; the left of \approx ~= ≈ ≃ ≅; and when it refuses the whole answer
# (any relation it does not know: \to, \iff, \sim, ＝, ...), math-verify reads the rightmost piece it can
# parse. Not here: the orderings and "not equal" it parses whole (< \le \ne ...: 0 < x < 7 is an interval).
_RELATION_RE = re.compile(
    r"(?:"
    # a symbol set over another, or an arrow with a label: \overset{?}{=}, \stackrel{def}{=}, \xrightarrow{f}
    rf"\\(?:overset|underset|stackrel){_ARG}{_ARG}"
    rf"|\\x[A-Za-z]*arrow(?:\[[^\]]*\])?{_ARG}"
    rf"|\\mathrel{_ARG}"
    # LaTeX's relation commands, amssymb's and mathtools' included: by family (a name holding arrow,
    # sim, approx, ...: \Longrightarrow, \backsim, \thickapprox, \coloneqq), then one by one
    r"|\\(?:[A-Za-z]*(?:arrow|harpoon|sim|approx|equiv|cong|[dD]oteq|dotseq|[bB]umpeq|[cC]olon"
    r"|prec|succ|less|gtr|subset|supset|Subset|Supset|mid|parallel|vdash|vDash|Vdash)[A-Za-z]*"
    r"|to|gets|iff|implies|impliedby|mapsto|longmapsto|mapsfrom|leadsto|multimap"
    r"|in|ni|owns|notin|asymp|propto|varpropto|between|pitchfork|models|dashv|therefore|because"
    r"|eqcirc|circeq|triangleq|smile|frown|bowtie|Join|perp|[lr]hd|un[lr]hd"
    r"|ll|gg|lll|ggg|n[lg]eq[A-Za-z]*|[lg]neqq?|[lg]vertneqq)(?![A-Za-z])"
    # ASCII arrows and equals (-> => <=> := =: == ~= ~; not the = of <= >= !=)
    r"|<?[-=]+>|(?<![<>!]):*[=~]+:*"
    # Unicode's arrows and relation characters (→ ⇒ ↦ ∈ ∝ ∼ ≈ ≡ ≟ ⊂ ⊢ ＝ ...)
    "|[\u2190-\u21ff\u27f0-\u27ff\u2900-\u297f\u2208-\u220d\u221d\u2223-\u2226\u2234-\u2237"
    "\u2239-\u2263\u2282-\u228b\u22a2-\u22af\u22cd\u2a74-\u2a76\ufe66\uff1d\uff5e])"
)


def prompt(row):
    return agent.prompt_text(row["question"], tools=TOOLS)


# the contract's two functions (the docstring above has their arguments and results)
def predict(turns):
    return agent.extract_answer(turns)


def grade(row, pred, turns, grader, trajectory):
    score = reward(turns, row["answer"], grader)  # 1.0 or 0.0
    return score, score == 1.0


def reward(response, gold, grader=None):
    """
    1.0 if the final answer of response (a text, or a list of sampled turns) equals gold, else 0.0.
    The rule, in order:
    1. the answer is the content of the last \\boxed{} inside the last <answer>...</answer> block of the
       final assistant turn, outside its tool-call blocks (agent.extract_answer); none -> 0;
    2. answer and gold are normalised: zero-width characters dropped, thousands separators between a
       digit and a group of three dropped (1\\,000, 1 000, 1~000, 1{,}000, a no-break or thin space:
       1000), the percent sign dropped (700\\% reads 700: it equals the golds 700 and 700\\%, not 7),
       runs of spaces of any kind made one " " and the ends stripped;
    3. an answer too big to parse is refused: 0 (grader.refuses: over grading.MAX_ANSWER_CHARS characters,
       or nested deeper than grading.MAX_DEPTH);
    4. the same text, or the same plain integer (-0012 = -12, grading.plain_int), is 1 without math-verify;
    5. otherwise verify() decides, in the grader's helper process (0 if it passes the grader's timeout):
       math-verify's verdict, except that a relation between two different numbers (8 = 7, 8 \\to 7,
       7 \\approx 8, ...: math-verify reads one side of each) is a hedge, 0.
    Without a grader, one of its own is made for this call (its helper starts when step 5 is reached: a
    few seconds); to grade many, pass one.
    """
    if grader is None:
        grader = grading.Grader(None, helpers=1)
        try:
            return reward(response, gold, grader)
        finally:
            grader.close()
    if not isinstance(gold, str):
        raise ValueError(f"gold answer must be a string, got {type(gold).__name__}: {gold!r}")
    pred = agent.extract_answer(response)
    if not pred:  # None or empty
        return 0.0
    pred = normalise(pred)
    gold = normalise(gold)
    if grader.refuses(pred):
        return 0.0
    if pred == gold:
        return 1.0
    pred_int = grading.plain_int(pred)
    gold_int = grading.plain_int(gold)
    if None not in (pred_int, gold_int):  # integer vs integer needs no sympy
        return float(pred_int == gold_int)
    return float(grader.run_in_helper(verify, gold, pred) is True)


def normalise(text):
    # zero-width characters out, thousands separators out, the percent sign out, any space -> one " "
    text = _SEPARATOR_RE.sub("", text.translate(_ZERO_WIDTH))
    return " ".join(re.sub(r"\\text\{\\%\}|\\?%", "", text).split())


def verify(gold, pred):
    """
    Runs in a grading helper process (it imports sympy): math-verify's verdict (gold and pred each wrapped
    in \\boxed{}), except that an answer relating two different numbers is a hedge and gets False. The
    sides of its relations (_RELATION_RE: =, :=, \\approx, \\equiv, \\sim, \\to, \\iff, \\in,
    \\overset{?}{=}, ＝, ...) that are numbers once simplified (sympy's is_number: not x, m + n or f(2);
    7 + 0 \\cdot x is 7) must all be equal, per math-verify. 8 = 7, 7 \\approx 8 and 8 \\to 7 are False for
    gold 7 (math-verify alone says True: it reads one side of each); x = 7, m + n = 7, f(2) = 7 and
    \\frac{14}{2} = 7 are True; \\frac{1}{3} \\approx 0.333 is False for gold 1/3 (math-verify does not take
    0.333 for 1/3 either, 0.333333 it does). math-verify reads the right side of =, so 7 = x is False.
    """
    import sympy
    from math_verify import parse, verify as math_verify

    def box(text):
        return parse("\\boxed{" + text + "}", parsing_timeout=None)
    # math-verify's verdict first: False too when it finds nothing to parse in one of them
    # (parse's [])
    if not math_verify(box(gold), box(pred), timeout_seconds=None):
        return False
    # its sides: the pieces between its relations that close as many brackets as they open. The others hold
    # part of a group around a relation, a subscript or an argument (\lim_{x \to 0} f(x) = 1, P(X = 2) =
    # \frac14, \left. f'(x) \right|_{x=1} = 3, \sum_{k=1}^{7} k = 28): not sides of the answer
    sides = [box(side) for side in _RELATION_RE.split(pred)
             if sum(map(side.count, "([{")) == sum(map(side.count, ")]}"))]
    numbers = [side for side in sides if side and isinstance(side[0], sympy.Expr)
               and sympy.simplify(side[0]).is_number]
    return all(math_verify(numbers[0], side, timeout_seconds=None) for side in numbers[1:])


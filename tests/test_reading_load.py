"""scripts/reading_load.py: what a reader of the demo must read, counted from a profiler's trace."""
import reward
from scripts import reading_load


def test_the_load_counts_each_function_once_with_its_file_and_lines():
    seen = {("train.py", "rl_step", 200): 50, ("train.py", "warm_start", 80): 60, ("envace.py", "collate", 90): 20}
    figures = reading_load.load(seen)
    assert (figures["functions"], figures["files"], figures["lines"]) == (3, 2, 130)
    assert list(figures["per_file"].items()) == [("train.py", (2, 110)), ("envace.py", (1, 20))]   # largest first


def test_the_trace_holds_the_repo_functions_a_run_enters_and_not_the_tests(monkeypatch):
    import train

    def short_run(argv):             # stands in for train.main: enters two functions of reward.py twice
        import os
        for _ in range(2):
            reward.group_advantages([1.0, 0.0], [0, 0], False)
            os.path.join("a", "b")                       # a frozen module's function (<frozen posixpath>)
        return 0
    monkeypatch.setattr(train, "main", short_run)
    seen, status = reading_load.traced_functions([])
    assert status == 0
    names = {(where, name) for where, name, _ in seen}
    assert ("reward.py", "group_advantages") in names
    assert not any(where.startswith("tests") for where, _ in names)      # this test file is not the repo's code
    assert not any(where.startswith("<") for where, _ in names)          # nor Python's frozen modules (<frozen os>)
    lines = {name: n for (where, name, _), n in seen.items() if where == "reward.py"}
    import inspect
    assert lines["group_advantages"] == len(inspect.getsourcelines(reward.group_advantages)[0])


def test_a_bad_option_is_one_line(capsys):
    assert reading_load.main(["--csv"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")

"""CI must run exactly the README's test command, and the README must open with the two commands."""


from tests.support.waiting import REPO

ROOT = REPO


def _indented_commands(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.startswith("    ") and line.strip()]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    main_job, test_cmd = _indented_commands(readme)[:2]
    assert "examples/quickstart.py" in main_job
    assert "pytest" in test_cmd
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_cmd in ci, ".ci/run must contain the README's test command verbatim"

"""The chaos suite's reports, collected for the summary table printed after the tests."""

from __future__ import annotations

import pytest

_REPORTS: list = []


@pytest.fixture
def chaos_reports() -> list:
    return _REPORTS


def pytest_terminal_summary(terminalreporter) -> None:
    if _REPORTS:
        from harness import table

        terminalreporter.write_sep("=", "chaos suite")
        terminalreporter.write_line(table(_REPORTS))

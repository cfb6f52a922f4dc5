"""The random-sequence suites: generated plans of operations run against real servers."""

"""ktserve's tests. A package: each test module is imported under its own path and the shared helpers under
theirs (tests.helpers, tests.conftest), so two folders may hold files of the same name."""

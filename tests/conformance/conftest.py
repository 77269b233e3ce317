"""The conformance suite runs on the integration tests' shared 1P1D stack (``pd_cluster``): imported here, it is
the same stack in one test process (tests/integration/conftest.py: ``shared_stack``), and tests/conftest.py's
``SHARED_STACKS`` runs this suite on the process that holds it."""

from tests.integration.conftest import pd_cluster  # noqa: F401  (the fixture)

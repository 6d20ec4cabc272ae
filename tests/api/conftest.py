"""Fixtures shared by the API tests: real BMC emulators on loopback (defined in test_power_api)."""

from tests.api.test_power_api import bmcs  # noqa: F401 - fixture

"""The `attend` console script (attend.cli): `attend serve` and `attend export`."""

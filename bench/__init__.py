"""Benchmarks of a checkout (not installed): `pcpstack bench <area>` runs `python -m bench <area>` here."""

"""Benchmarks behind `pcpstack bench <area>`: each module has add_arguments(parser) and run(args) -> dict."""

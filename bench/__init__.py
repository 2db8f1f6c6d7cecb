"""Benchmarks behind `pcpstack bench <area>`; each module offers add_arguments(parser) and run(args) -> dict."""

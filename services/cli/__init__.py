"""The `pcpstack` command line: `serve`, `up`, `generate`, `status`, `config check`, `certs` and `bench`."""

"""Tests of the docker-compose deployment in compose/."""

"""Tests of the pcpstack command line, the local stack it starts and the README it documents."""

"""mmkey's test suite, one folder per area of the library; a package so helpers import as `tests._support`."""

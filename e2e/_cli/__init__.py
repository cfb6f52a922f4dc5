"""The ``midflight`` command line: on top of everything else in e2e, imported by nothing but the package itself."""

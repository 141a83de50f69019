"""The ``moedoctor`` command line: one module per subcommand, joined in ``main``."""

"""Bad-input catalogues: a package, so that their basenames (test_cli, ...) may repeat those of tests/."""

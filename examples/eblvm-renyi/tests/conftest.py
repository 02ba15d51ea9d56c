pytest_plugins = ["eblvm.testing"]  # eblvm's test kit: the fixtures linear_gaussian, tiny_grbm and short_run

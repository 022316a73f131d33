from envbuild.cli.main import entry

entry()

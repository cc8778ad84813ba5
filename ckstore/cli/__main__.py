from ckstore.cli.base import run

run()

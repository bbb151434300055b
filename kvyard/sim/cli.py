"""`kvyard sim serve` (simulated pods) and `kvyard sim calibrate` (a profile from a real
CPU worker). Heavy imports stay inside `run`, as every kvyard subcommand's."""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvyard.sim import calibrate, config

    sub = p.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    serve = sub.add_parser("serve", help="run simulated worker pods (one HTTP port each)",
                           description=config.__doc__.splitlines()[0])
    config.add_arguments(serve)
    cal = sub.add_parser("calibrate", help="measure a real CPU worker, write a latency profile",
                         description=calibrate.__doc__.splitlines()[0])
    calibrate.add_arguments(cal)


def run(args: argparse.Namespace) -> int:
    if args.sim_command == "calibrate":
        from kvyard.sim import calibrate

        return calibrate.run(args)
    if args.sim_command != "serve":
        print("kvyard sim: serve or calibrate (kvyard sim --help)", file=sys.stderr)
        return 2
    import asyncio
    import logging

    from kvyard.sim import config, pool

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        profile = config.profile_of(args)
        plans = config.plan_pods(args)
        settings = pool.settings_of(args, profile)
    except ValueError as e:
        print(f"kvyard sim serve: {e}", file=sys.stderr)
        return 2
    asyncio.run(pool.serve(plans, settings, args.model, args.host))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvyard sim")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""Typer commands only: parse, call one library function, print. Heavy libraries are imported
inside the commands that need them."""

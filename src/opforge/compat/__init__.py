"""Drop-in signatures of other libraries' operators, computed by opforge."""

"""Guided decoding: json_object (JSON mode), schema (json_schema), regex (guided_regex)
and choice (guided_choice), each a character-level state behind one `Constraint`
(constraint.py) that the sampler calls; vocab.py makes a request's constraint."""

"""Ray actors of the pipeline: the generation UDF (actor.py) and its engine (engine/)."""

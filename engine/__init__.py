"""One replica's compute: models, weight loading, runner, scheduler, sampler, structured output."""

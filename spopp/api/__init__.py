"""The tracker's wire: its REST API's typed bodies, the client, the trajectory record a replica posts
to the learner, strict JSON, and creating a run with its tasks."""

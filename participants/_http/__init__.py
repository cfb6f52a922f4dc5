"""The control routes over HTTP: the ``/ng-control/v1/checkpoint/*`` router, bearer auth, the error envelope, body limits."""

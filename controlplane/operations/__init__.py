"""Operations: attach/detach/apply-config over chosen workers, one state machine per target, run by Celery."""

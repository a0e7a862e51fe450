# The trims runtime image: the project and its dependencies installed from wheels that
# build-image.sh built on the host, on a base image given as a build argument. The build needs
# no network (build-image.sh runs it with --network none) and pulls nothing from a registry.
#
#   docker build --network none --build-arg BASE_IMAGE=trims-base:bookworm \
#     -f dockerfiles/runtime.Dockerfile CONTEXT
#
# CONTEXT holds project/ (the trims wheel) and deps/ (every dependency's wheel). The base must provide python3 with venv
# (build-base.sh makes one from Debian packages with debootstrap) and, optionally, tini.
ARG BASE_IMAGE=trims-base:bookworm
FROM ${BASE_IMAGE}

ARG TRIMS_UID=10001

# Dependencies first, the project second: a change to trims alone reuses the dependency layer.
COPY deps/ /tmp/deps/
RUN python3 -m venv /opt/trims \
 && /opt/trims/bin/pip install --no-index --no-cache-dir --find-links /tmp/deps /tmp/deps/*.whl \
 && rm -rf /tmp/deps \
 && echo "trims:x:${TRIMS_UID}:${TRIMS_UID}:trims function:/home/trims:/usr/sbin/nologin" >> /etc/passwd \
 && echo "trims:x:${TRIMS_UID}:" >> /etc/group \
 && mkdir -p /home/trims /run/trims/w \
 && chown "${TRIMS_UID}:${TRIMS_UID}" /home/trims /run/trims/w
COPY project/ /tmp/project/
RUN /opt/trims/bin/pip install --no-index --no-cache-dir --no-deps /tmp/project/*.whl \
 && rm -rf /tmp/project \
 && /opt/trims/bin/trims --version

ENV PATH=/opt/trims/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/trims \
    TRIMS_SOCKET=/run/trims/store.sock
USER ${TRIMS_UID}:${TRIMS_UID}
WORKDIR /home/trims
# The frameworks this image serves (import names, comma-separated): each must import here, as
# the function's user, or the build fails; the label below then says what the image can import
# and the docker executor refuses at deploy a function whose models need anything else.
ARG FRAMEWORKS=numpy
RUN python3 -c 'import importlib, sys; [importlib.import_module(m) for m in sys.argv[1].split(",")]' \
      "${FRAMEWORKS}"
# Declared last: a new digest on every source change must not invalidate the layers above.
ARG SOURCE_DIGEST=unknown
LABEL org.trims.image="runtime" \
      org.trims.frameworks="${FRAMEWORKS}" \
      org.trims.source-digest="${SOURCE_DIGEST}"
# tini reaps children and forwards SIGTERM so the worker drains before the container stops.
ENTRYPOINT ["/usr/bin/tini", "--", "trims"]
CMD ["--help"]

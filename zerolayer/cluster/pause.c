/* The pod sandbox's "pause" process: holds the pod's namespaces open until it is told to stop.
 *
 * Built static (gcc -static) by zerolayer/cluster/images.py and imported into each real node's
 * containerd under the sandbox image name its CRI config names, because no registry is reachable here.
 * It is PID 1 of the pod when the PID namespace is shared, so it also reaps orphaned children.
 */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
    (void)sig;
    _exit(0);
}

static void on_child(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction stop = {.sa_handler = on_stop};
    struct sigaction child = {.sa_handler = on_child, .sa_flags = SA_NOCLDSTOP};
    if (sigaction(SIGINT, &stop, NULL) < 0 || sigaction(SIGTERM, &stop, NULL) < 0 ||
        sigaction(SIGCHLD, &child, NULL) < 0) {
        return 1;
    }
    for (;;) {
        pause();
    }
}
